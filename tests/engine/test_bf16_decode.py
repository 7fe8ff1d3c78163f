"""compute_dtype "bfloat16" on the default GGUF (SmolLM2, kept blocks): a decode step of 16
choices runs its products in bf16 (the native stack's projections and the LM head through
the weights' bf16 descriptors), and its tokens and logprobs stay close to float32 mode's
(a loose check: bf16 rounding is not exact)."""

from __future__ import annotations

import pytest
import torch

from plait import LLM, SamplingParams
from plait.engine.models.linear import QuantLinear
from plait.kernels.cpu import build, native

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")

PROMPTS = [f"{topic} in one sentence:" for topic in (
    "Explain gravity", "Describe the sea", "Define a prime number", "Explain rain",
    "Describe a cat", "Explain photosynthesis", "Define an atom", "Describe Paris",
    "Explain a rainbow", "Describe winter", "Define energy", "Explain sleep",
    "Describe a forest", "Explain the moon", "Define music", "Describe bread")]
TOKENS = 8


def _run(compute_dtype: str) -> tuple[LLM, list[list[int]], list[list[float]]]:
    """(the LLM, each choice's greedy token ids, their logprobs) for the 16 prompts decoded
    together (16 rows a step)."""
    llm = LLM(weights="auto", compute_dtype=compute_dtype, num_kv_blocks=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    choices = [o.outputs[0] for o in outs]
    return (llm, [c.token_ids for c in choices],
            [[lp.logprob for lp in c.logprobs or []] for c in choices])


def test_bf16_decode_of_16_choices_is_close_to_float32() -> None:
    llm, bf16_ids, bf16_lps = _run("bfloat16")
    model = llm.engine.runner.model
    assert model.stack is not None  # the projections run inside plait_decoder_stack
    layer = model.layers[0]
    for name, linear in (("qkv_weight", layer.self_attn.qkv_proj),
                         ("down_weight", layer.mlp.down_proj)):  # the bf16 descriptors
        column = native.STACK_POINTERS.index(name)
        assert model.stack.layers[0, column] == linear.qweight.desc_bf16.data_ptr()
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.compute_dtype == torch.bfloat16
    _, f32_ids, f32_lps = _run("float32")
    agree = sum(a == b for ids_a, ids_b in zip(bf16_ids, f32_ids, strict=True)
                for a, b in zip(ids_a, ids_b, strict=True))
    assert agree >= 0.75 * len(PROMPTS) * TOKENS
    diffs = []  # logprobs of the same tokens: each choice up to where its tokens diverge
    for ids_a, ids_b, lps_a, lps_b in zip(bf16_ids, f32_ids, bf16_lps, f32_lps, strict=True):
        for a, b, lp_a, lp_b in zip(ids_a, ids_b, lps_a, lps_b, strict=True):
            if a != b:
                break
            diffs.append(abs(lp_a - lp_b))
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5
