"""`numerics` "int8" (the default here) on the default GGUF (SmolLM2: Q4_1 layers, a Q8_0
head tied to the embedding): every kept linear is repacked at load (1.0x the blocks' bytes
for these types) and computes through the repacked row, the native stack through the
flagged descriptors; the blocks are released, the embedding's rows read from the head's
repacked layout (the exact mode's bits); the stack's decode steps are the layer loop's bit
for bit, and decoded tokens and logprobs stay close to the exact mode's."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy

from plait import LLM
from plait.engine.models.linear import Linear, weight_bytes
from plait.kernels.cpu import build, repack
from plait.kernels.cpu.products import row

pytestmark = pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                                reason="no AVX512-VNNI repacked kernel in this build")


def _llm(**options) -> LLM:
    return LLM(weights="auto", num_kv_blocks=128, block_size=16, warm_up_tokens=0, **options)


def test_repacked_weights_engine() -> None:
    exact = _llm(numerics="exact")
    exact_model = exact.engine.runner.model
    file_bytes = {name: m.qweight.nbytes for name, m in exact_model.named_modules()
                  if isinstance(m, Linear) and m.qweight is not None}
    ids = torch.tensor([0, 17, 4242, 49151])
    exact_rows = exact_model.embed_tokens(ids)
    exact_decode = greedy.decode(exact)
    del exact, exact_model

    llm = _llm()  # numerics "auto": int8 for a GGUF file on this (VNNI) CPU
    assert llm.engine.runner.numerics.name == "int8"
    model = llm.engine.runner.model
    repacked = {name: m for name, m in model.named_modules() if isinstance(m, Linear)
                and m.product.name == f"repacked/{repack.ISA_NAMES[repack.isa()]}"}
    assert set(repacked) == set(file_bytes) and "lm_head" in repacked
    for name, linear in repacked.items():
        state = linear.state
        assert state is not None and state.packed is not None and state.desc is not None
        assert int(state.desc[0]) & repack.REPACKED_FLAG
        assert state.packed.numel() == file_bytes[name]  # Q4_1 / Q8_0: the file's bytes
        assert linear.qweight is None and linear.dropped is not None
        assert set(linear.dropped.split("+")) <= {"Q4_1", "Q8_0"}
    # the tied embedding reads the head's repacked rows: no blocks are left
    assert model.embed_tokens.qweight is None
    assert model.embed_tokens.repacked is model.lm_head.state
    assert torch.equal(model.embed_tokens(ids), exact_rows)
    kept_bytes, dense_bytes = weight_bytes(model)
    assert kept_bytes == 0 and dense_bytes >= sum(file_bytes.values())
    with pytest.raises(RuntimeError, match="released once repacked"):
        model.lm_head.select(row("kept/f32"))
    layer = model.layers[0]
    stacked = greedy.stacked_decode(llm, model, {
        "qkv_weight": layer.self_attn.qkv_proj, "gate_up_weight": layer.mlp.gate_up_proj,
        "down_weight": layer.mlp.down_proj})

    agree, diffs = greedy.compare(stacked, exact_decode)
    assert agree >= 0.75 * len(greedy.PROMPTS) * greedy.TOKENS
    assert 0 < max(diffs) < 1.0 and sum(diffs) / len(diffs) < 0.1
