"""`numerics` "bf16" (a bfloat16 KV cache) on the default GGUF (SmolLM2):
the attention's tokens take bf16 dot products (kernels/cpu/attention_bf16.h) in both
paths that attend them, the layer-by-layer prefill (its causal tiles) and the native
decoder stack (decode rows, n choices sharing their prompt), and the results stay close to the same
engine with that attention in float32 (a loose check: bf16 rounding is not exact)."""

from __future__ import annotations

import random

import pytest
import torch

from plait import LLM, SamplingParams
from plait.bench.workloads import random_words
from plait.kernels.cpu import build, native

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")

PROMPT = random_words(random.Random(0), 200)  # ~200 tokens: a prefill of many tiles
CHOICES, TOKENS = 4, 12
KV_BF16 = native.KV_DTYPES[torch.bfloat16]


def _llm(numerics: str, kv_cache_dtype: str) -> LLM:
    return LLM(weights="auto", numerics=numerics, kv_cache_dtype=kv_cache_dtype,
               num_kv_blocks=128, block_size=16)


def _float32_attention(llm: LLM) -> LLM:
    """`llm` with its attention's dot products back in float32 (the ops table's dtype and
    the native stack's kv_dtype code), its GEMMs still bf16: what this change alone does."""
    runner = llm.engine.runner
    runner.ops.compute_dtype = torch.float32
    runner.model.bind(runner.kv_caches)
    return llm


def _run(llm: LLM) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """(the prompt's logprobs, each greedy choice's token ids and logprobs)."""
    params = SamplingParams(n=CHOICES, temperature=0, max_tokens=TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    out = llm.generate([PROMPT], params)[0]
    assert out.prompt_logprobs is not None
    prompt = [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]
    return (prompt, [c.token_ids for c in out.outputs],
            [[lp.logprob for lp in c.logprobs or []] for c in out.outputs])


def test_the_flag_reaches_the_stack_only_for_bf16_caches_and_compute() -> None:
    codes = {}
    for numerics, kv in (("bf16", "auto"), ("exact", "bfloat16"), ("exact", "auto")):
        runner = _llm(numerics, kv).engine.runner
        assert runner.ops.compute_dtype == (torch.bfloat16 if numerics == "bf16"
                                            else torch.float32)
        assert runner.model.stack is not None
        codes[numerics, kv] = runner.model.stack.kv_dtype
    assert codes == {("bf16", "auto"): KV_BF16 | native.ATTN_BF16_DOT,  # auto: bf16 there
                     ("exact", "bfloat16"): KV_BF16,
                     ("exact", "auto"): native.KV_DTYPES[torch.float32]}


def test_bf16_attention_is_close_to_float32_attention() -> None:
    prompt, ids, lps = _run(_llm("bf16", "auto"))
    prompt_f32, ids_f32, lps_f32 = _run(_float32_attention(_llm("bf16", "auto")))
    diffs = [abs(a - b) for a, b in zip(prompt, prompt_f32, strict=True)]
    assert len(diffs) > 150  # measured: mean 0.04, max 0.16 (AMD EPYC, AVX512-BF16)
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.5
    if "avx512_bf16" in build._cpu_flags():
        assert max(diffs) > 0  # the prefill's tiles took the bf16 path
    agree, decode_diffs = 0, []
    for a_ids, b_ids, a_lps, b_lps in zip(ids, ids_f32, lps, lps_f32, strict=True):
        for a, b, lp_a, lp_b in zip(a_ids, b_ids, a_lps, b_lps, strict=True):
            if a != b:
                break
            agree += 1
            decode_diffs.append(abs(lp_a - lp_b))
    assert agree >= 0.75 * CHOICES * TOKENS  # measured: all 48, logprobs within 0.062
    assert sum(decode_diffs) / len(decode_diffs) < 0.1 and max(decode_diffs) < 0.5
