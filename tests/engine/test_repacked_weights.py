"""`repacked_weights` on the default GGUF (SmolLM2: Q4_1 layers, a Q8_0 head tied to the
embedding): every kept linear is repacked at load (1.0x the blocks' bytes for these types)
and computes through the repacked row, the native stack through the flagged descriptors;
the stack's decode steps are the layer loop's bit for bit, and decoded tokens and logprobs
stay close to the exact mode's."""

from __future__ import annotations

import pytest
from helpers import greedy

from plait import LLM
from plait.engine.models.linear import Linear
from plait.kernels.cpu import build, native, repack

pytestmark = pytest.mark.skipif(not build.available() or repack.isa() != repack.ISA_VNNI512,
                                reason="no AVX512-VNNI repacked kernel in this build")


def _llm(**options) -> LLM:
    return LLM(weights="auto", num_kv_blocks=128, block_size=16, warm_up_tokens=0, **options)


def test_repacked_weights_engine() -> None:
    llm = _llm(repacked_weights=True)
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert kept and model.lm_head in kept
    for linear in kept:
        state = linear.state
        assert linear.product.name == "repacked/avx512-vnni" and state is not None
        assert state.packed is not None and state.desc is not None
        assert int(state.desc[0]) & repack.REPACKED_FLAG
        assert state.packed.numel() == linear.qweight.nbytes  # Q4_1 / Q8_0: the file's bytes
    assert model.stack is not None
    layer = model.layers[0]
    for name, linear in (("qkv_weight", layer.self_attn.qkv_proj),
                         ("gate_up_weight", layer.mlp.gate_up_proj),
                         ("down_weight", layer.mlp.down_proj)):
        assert model.stack.layers[0, native.STACK_POINTERS.index(name)] \
            == linear.state.desc.data_ptr()

    stacked = greedy.decode(llm)
    stack, model.stack = model.stack, None  # the layer loop through the rows' kernels
    try:
        assert greedy.decode(llm) == stacked
    finally:
        model.stack = stack
    del llm

    agree, diffs = greedy.compare(stacked, greedy.decode(_llm()))
    assert agree >= 0.75 * len(greedy.PROMPTS) * greedy.TOKENS
    assert 0 < max(diffs) < 1.0 and sum(diffs) / len(diffs) < 0.1
