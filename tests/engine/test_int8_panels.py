"""`int8_panels` on the default GGUF (SmolLM2, kept blocks): every kept linear packs its
int8 panels at load and sends products of any row count to them, the native stack through
the flagged descriptors; the stack's decode steps are the layer loop's bit for bit; a
prefill is `prefill_int8`'s bit for bit (the same kernel, from panels instead of blocks);
decoded tokens and logprobs stay close to the exact mode's."""

from __future__ import annotations

import random

import pytest
from helpers import greedy

from plait import LLM, SamplingParams
from plait.bench.workloads import random_words
from plait.engine.models.linear import Linear, weight_bytes
from plait.kernels.cpu import build, native
from plait.kernels.cpu.products import INT8_PANEL_MIN_ROWS

pytestmark = pytest.mark.skipif(not build.available() or not native.has_qgemm_i8(),
                                reason="no qgemm_i8 in this build (needs AVX512-VNNI)")


def _llm(**options) -> LLM:
    return LLM(weights="auto", num_kv_blocks=128, block_size=16, warm_up_tokens=0, **options)


def _prompt_logprobs(llm: LLM, prompt: str) -> list[float]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    return [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]


def test_int8_panels_engine() -> None:
    llm = _llm(int8_panels=True)
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert kept and model.lm_head in kept
    for linear in kept:
        state = linear.state
        assert linear.product.name == "kept-i8panels/f32" and state is not None
        assert state.packed is not None and state.desc is not None
        assert int(state.desc[-1]) == INT8_PANEL_MIN_ROWS  # the flagged descriptor's i8 rows
        assert int(state.desc[0]) & native.I8_PANELS
    kept_bytes, dense_bytes = weight_bytes(model)
    panel_bytes = sum(m.state.packed.numel() for m in {id(m): m for m in kept}.values())
    assert dense_bytes >= panel_bytes > kept_bytes  # 1.25 bytes a weight against ~0.6
    layer = model.layers[0]
    stacked = greedy.stacked_decode(llm, model, {
        "qkv_weight": layer.self_attn.qkv_proj, "gate_up_weight": layer.mlp.gate_up_proj})

    prompt = random_words(random.Random(3), 160)
    panels_lps = _prompt_logprobs(llm, prompt)
    del llm
    prefill = _llm(prefill_int8=True)
    assert _prompt_logprobs(prefill, prompt) == panels_lps
    del prefill

    agree, diffs = greedy.compare(stacked, greedy.decode(_llm()))
    assert agree >= 0.75 * len(greedy.PROMPTS) * greedy.TOKENS
    assert 0 < max(diffs) < 1.0 and sum(diffs) / len(diffs) < 0.1
