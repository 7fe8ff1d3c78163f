"""`kv_cache_dtype` ("auto" | "bfloat16" | "float32", `--kv-cache-dtype`): the option's
validation and resolution, the pool it sizes (twice the blocks in the same memory), an
engine with a bfloat16 KV cache generating (prompt sharing for n choices intact, greedy
tokens close to those of the float32 cache), and a float32 cache under the int8 numerics."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.engine import SHARING, make_llm, prompt, solo_tokens

from plait import SamplingParams
from plait.engine.config import EngineConfig
from plait.engine.kv_cache import resolve_kv_dtype
from plait.engine.llm import LLM
from plait.kernels.cpu import build, native, repack

PROMPT_LEN = 60  # block_size 16: 3 full blocks + a partial one (copied on write)
BF16 = dict(kv_cache_dtype="bfloat16")


def test_config_validates_kv_cache_dtype() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig.from_kwargs(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_kwargs(kv_cache_dtype="float32").kv_cache_dtype == "float32"
    for bad in ("float16", "fp8", "f32"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)


def test_kv_dtype_resolution() -> None:
    """auto: the model dtype; bfloat16 on the CPU whatever the activations; on CUDA (no
    GPU needed: a rule on dtypes) only with a bfloat16 model, else a clear error."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    # float32 whatever the numerics' own choice (`auto`, here bf16 as under int8)
    assert resolve_kv_dtype("float32", torch.float32, cpu, torch.bfloat16) == torch.float32
    assert resolve_kv_dtype("auto", torch.float32, cpu, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        resolve_kv_dtype("bfloat16", torch.float16, cuda)
    with pytest.raises(ValueError, match="needs a float32 model"):
        resolve_kv_dtype("float32", torch.bfloat16, cuda)


def test_bf16_pool_holds_twice_the_blocks(tiny_path, caplog) -> None:
    """The same kv_cache_memory_gb: twice the blocks (floor of twice the budget), each of
    half the bytes, in a cache of bfloat16; the engine reports the count."""
    options = dict(num_kv_blocks=None, kv_cache_memory_gb=0.01, block_size=16)
    f32 = make_llm(tiny_path, **options)
    with caplog.at_level(logging.INFO, logger="plait.engine"):
        bf16 = make_llm(tiny_path, **options, **BF16)
    runners = f32.engine.runner, bf16.engine.runner
    assert (runners[0].kv_cache.dtype, runners[1].kv_cache.dtype) == (torch.float32,
                                                                      torch.bfloat16)
    blocks = runners[0].num_blocks
    assert runners[1].num_blocks in (2 * blocks, 2 * blocks + 1)
    assert bf16.engine.info.num_kv_blocks == runners[1].num_blocks
    assert runners[1].kv_cache.nbytes <= 0.01 * 2**30 < runners[1].kv_cache.nbytes + \
        runners[1].kv_cache[:, :, :1].nbytes
    assert f"KV cache: {runners[1].num_blocks} blocks of 16 tokens, bfloat16" in caplog.text


def test_shared_choices_equal_solo_runs_with_a_bf16_cache(tiny_path) -> None:
    """n choices of one prompt on a bfloat16 cache: the prompt computed once, its partial
    block copied on write, each seeded choice the tokens it gets alone."""
    ids = prompt(6, PROMPT_LEN)
    llm = make_llm(tiny_path, **SHARING, **BF16)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    seeded = SamplingParams(n=4, temperature=1.0, seed=100, max_tokens=8, ignore_eos=True)
    out = llm.generate([ids], seeded)[0].outputs
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN
    for i, choice in enumerate(out):
        params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8, ignore_eos=True)
        assert choice.token_ids == solo_tokens(tiny_path, ids, params, **SHARING, **BF16)
    assert len({tuple(c.token_ids) for c in out}) > 1, "different seeds give different tokens"


def test_bf16_cache_greedy_tokens_follow_the_float32_cache(default_model) -> None:
    """The default model (real weights) decodes greedily with both caches, prompts sharing
    a prefix and n = 2 choices: with bf16 K/V the tokens agree with float32's on most
    positions (the logprob differences are measured in BENCHMARKS.md, not here)."""
    prompts = ["The capital of France is", "Write a haiku about the sea:",
               "def fibonacci(n):", "The capital of France is a city that"]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(None, kv_cache_dtype=kv, numerics="exact", num_kv_blocks=128, block_size=16)
        outputs[kv] = [[c.token_ids for c in out.outputs]
                       for out in llm.generate(prompts, greedy)]
        for choices in outputs[kv]:
            assert choices[0] == choices[1]  # shared prompt, the same greedy tokens
    agree = total = 0
    for a, b in zip(outputs["auto"], outputs["bfloat16"], strict=True):
        agree += sum(x == y for x, y in zip(a[0], b[0], strict=True))
        total += len(a[0])
    assert agree >= 0.75 * total, (agree, total)


@pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                    reason="--numerics int8 needs the AVX512-VNNI repacked kernel")
def test_a_float32_cache_under_int8_attends_in_float32() -> None:
    """`--kv-cache-dtype float32` under `--numerics int8`: the repacked int8 products with a
    float32 cache and attention (the native stack's float32 code, no bf16 dot products), so
    the prompt's logprobs are nearer the exact mode's than with int8's own bf16 cache (its
    quality figures: BENCHMARKS.md). The prompt rows go through the int8 products here too
    (as generated rows do; where the process has AMX-BF16 they would take those tiles), so
    that only the caches differ."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 3 +
              "def fibonacci(n):\n    if n < 2:\n        return n\n")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs, codes = {}, {}
    for numerics, kv in (("exact", "auto"), ("int8", "float32"), ("int8", "auto")):
        llm = LLM(None, numerics=numerics, kv_cache_dtype=kv, num_kv_blocks=64)
        runner = llm.engine.runner
        assert runner.numerics.name == numerics and runner.model.stack is not None
        runner.split_prompt_rows = False
        codes[numerics, kv] = (runner.kv_cache.dtype, runner.model.stack.kv_dtype)
        out = llm.generate([prompt], params)[0]
        assert out.prompt_logprobs is not None
        logprobs[numerics, kv] = [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]
    assert codes["int8", "float32"] == codes["exact", "auto"] == \
        (torch.float32, native.KV_DTYPES[torch.float32])
    assert codes["int8", "auto"] == (torch.bfloat16,
                                     native.KV_DTYPES[torch.bfloat16] | native.ATTN_BF16_DOT)
    exact = logprobs["exact", "auto"]

    def mean_gap(run: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(run, exact, strict=True)) / len(exact)

    assert len(exact) > 30
    assert 0 < mean_gap(logprobs["int8", "float32"]) < mean_gap(logprobs["int8", "auto"])
