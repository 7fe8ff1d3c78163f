"""`numerics` "bf16" on the default GGUF (SmolLM2, kept blocks): a decode step of 16
choices runs its products in bf16 (the native stack's projections and the LM head through
the weights' bf16 descriptors), and its tokens and logprobs stay close to float32 mode's
(a loose check: bf16 rounding is not exact)."""

from __future__ import annotations

import pytest
from helpers import greedy

from plait import LLM
from plait.engine.models.linear import Linear
from plait.kernels.cpu import build, native

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")


def _run(numerics: str) -> tuple[LLM, tuple[list[list[int]], list[list[float]]]]:
    """(the LLM, its greedy decode of the 16 prompts: token ids and logprobs)."""
    llm = LLM(weights="auto", numerics=numerics, num_kv_blocks=128, block_size=16)
    return llm, greedy.decode(llm)


def test_bf16_decode_of_16_choices_is_close_to_float32() -> None:
    llm, bf16 = _run("bf16")
    model = llm.engine.runner.model
    assert model.stack is not None  # the projections run inside plait_decoder_stack
    layer = model.layers[0]
    for name, linear in (("qkv_weight", layer.self_attn.qkv_proj),
                         ("down_weight", layer.mlp.down_proj)):  # the bf16 descriptors
        column = native.STACK_POINTERS.index(name)
        assert model.stack.layers[0, column] == linear.qweight.desc_bf16.data_ptr()
    assert isinstance(model.lm_head, Linear) and model.lm_head.product.name == "kept/bf16"
    agree, diffs = greedy.compare(bf16, _run("exact")[1])
    assert agree >= 0.75 * len(greedy.PROMPTS) * greedy.TOKENS
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5
