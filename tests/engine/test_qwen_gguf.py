"""Opt-in: Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF served in its own format (qwen2: q/k/v
biases, unpermuted rows, Q5_0 with Q8_0 v in half the layers, Q4_K/Q6_K ffn_down, an untied
Q8_0 head), greedy tokens equal to transformers' on the same file. Skipped unless the file
is already at QWEN_GGUF (nothing downloads it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.model import greedy_reference

from plait import LLM, SamplingParams
from plait.engine.models.linear import Linear, QuantEmbedding

QWEN_GGUF = Path(os.environ.get(
    "PLAIT_QWEN_GGUF",
    Path.home() / ".cache/plait/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
PROMPTS = ["def quicksort(items):\n",
           "The three laws of thermodynamics are",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"]
NUM_TOKENS = 24

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not QWEN_GGUF.is_file(), reason=f"no {QWEN_GGUF}")]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(QWEN_GGUF), num_kv_blocks=32, block_size=16, numerics="exact")


def test_qwen_keeps_mixed_types(llm) -> None:
    model = llm.engine.runner.model
    types = {layer.self_attn.qkv_proj.qweight.describe() for layer in model.layers}
    assert types == {"Q5_0+Q5_0+Q5_0", "Q5_0+Q5_0+Q8_0"}
    assert {layer.mlp.down_proj.qweight.describe() for layer in model.layers} == \
        {"Q4_K", "Q6_K"}
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, Linear) and model.lm_head.qweight is not None
    assert model.lm_head.qweight.describe() == "Q8_0"
    assert llm.engine.runner.weight_bytes <= 1.1 * QWEN_GGUF.stat().st_size


def test_qwen_greedy_equals_transformers(llm) -> None:
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    eos = list(llm.engine.info.eos_token_ids)  # the engine's: its config's + tokenizer's
    expected = greedy_reference(QWEN_GGUF, prompts, eos, NUM_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
