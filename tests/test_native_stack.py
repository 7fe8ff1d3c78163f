"""`LlamaForCausalLM.native_stack` (one C call for every layer of a few-row step,
kernels/cpu_decoder.c) against the eager layer loop it replaces: the same bits, in the
hidden states and in every K/V it writes, and None wherever that loop would not be native."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import prompt
from test_model_parity import PagedHarness
from tiny_model import make_tiny_model

from plait.engine.model_config import ModelConfig
from plait.engine.models.cpu_linear import NATIVE_MAX_ROWS, prepack_cpu_linears
from plait.engine.models.llama import LlamaForCausalLM
from plait.engine.weights import load_weights
from plait.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

SHARED = 20  # prompt tokens the first four sequences share: 5 blocks of 4


def _model(tmp_path, default_model, model_type: str, prepack: bool = True) -> LlamaForCausalLM:
    path = make_tiny_model(tmp_path / model_type, default_model.path, model_type)
    model = LlamaForCausalLM(ModelConfig.from_dir(path), 2048)
    load_weights(model, path)
    if prepack:
        prepack_cpu_linears(model)
    return model.eval()


def _sequences() -> list[tuple[list[int], list[int]]]:
    """(tokens, block table): four sequences on one 20-token prompt (its 5 blocks shared, as
    n choices are), then two alone."""
    base = prompt(0, SHARED)
    seqs = [(base + prompt(1 + i, 3 + i), [0, 1, 2, 3, 4, 10 + 2 * i, 11 + 2 * i])
            for i in range(4)]
    seqs += [(prompt(10 + i, 9 + 2 * i), [30 + 4 * i + b for b in range(4)]) for i in range(2)]
    return seqs


def _prefilled(model: LlamaForCausalLM) -> PagedHarness:
    """Every sequence's tokens but its last in the cache (the shared prompt computed once)."""
    harness = PagedHarness(model.config, num_blocks=48, block_size=4)
    seqs = _sequences()
    harness.run(model, [(seqs[0][0][:-1], 0, seqs[0][1])])
    harness.run(model, [(t[:-1], SHARED, table) for t, table in seqs[1:4]])
    harness.run(model, [(t[:-1], 0, table) for t, table in seqs[4:]])
    return harness


def _both(model: LlamaForCausalLM, harness: PagedHarness, ids, positions, meta):
    """(native stack's hidden states and caches, the eager layer loop's)."""
    kv_stack, kv_loop = copy.deepcopy(harness.kv), copy.deepcopy(harness.kv)
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        stacked = model.native_stack(x.clone(), positions, kv_stack, meta)
        looped = x.clone()
        for layer, kv in zip(model.layers, kv_loop, strict=True):
            looped = layer(positions, looped, kv, meta)
        looped = model.norm(looped)
    return (stacked, kv_stack), (looped, kv_loop)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: a q|k|v bias
def test_decode_step_is_the_layer_loop_bit_for_bit(tmp_path, default_model, model_type) -> None:
    """Six decode rows in an order that interleaves the shared group with rows alone, so
    the attention's chunk order differs from the token order."""
    model = _model(tmp_path, default_model, model_type)
    harness = _prefilled(model)
    seqs = _sequences()
    order = [4, 0, 1, 5, 2, 3]
    ids, positions, meta = harness.step([(seqs[i][0], len(seqs[i][0]) - 1, seqs[i][1])
                                         for i in order])
    (stacked, kv_stack), (looped, kv_loop) = _both(model, harness, ids, positions, meta)
    assert stacked is not None and stacked.shape == (6, model.config.hidden_size)
    assert torch.equal(stacked, looped)
    for (k, v), (k_ref, v_ref) in zip(kv_stack, kv_loop, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    changed = (kv_stack[0][0] != harness.kv[0][0]).any(dim=(1, 2, 3)).nonzero().flatten()
    # the six new tokens' blocks, each written once
    written = sorted({seqs[i][1][(len(seqs[i][0]) - 1) // 4] for i in order})
    assert changed.tolist() == written


def test_a_small_mixed_step_is_the_layer_loop_bit_for_bit(tmp_path, default_model) -> None:
    """Two decode rows and a 5-token prefill continuation in one step (prefill tiles)."""
    model = _model(tmp_path, default_model, "llama")
    harness = _prefilled(model)
    seqs = _sequences()
    extra = seqs[5][0] + prompt(99, 4)  # the last row's prompt grows by a 5-token chunk
    rows = [(seqs[0][0], len(seqs[0][0]) - 1, seqs[0][1]),
            (extra, len(seqs[5][0]) - 1, seqs[5][1] + [46]),
            (seqs[4][0], len(seqs[4][0]) - 1, seqs[4][1])]
    ids, positions, meta = harness.step(rows)
    assert ids.shape == (7,)
    (stacked, kv_stack), (looped, kv_loop) = _both(model, harness, ids, positions, meta)
    assert stacked is not None and torch.equal(stacked, looped)
    for (k, v), (k_ref, v_ref) in zip(kv_stack, kv_loop, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_not_taken_where_the_loop_is_not_all_native(tmp_path, default_model,
                                                    monkeypatch) -> None:
    model = _model(tmp_path, default_model, "llama")
    harness = _prefilled(model)
    seqs = _sequences()
    ids, positions, meta = harness.step([(t, len(t) - 1, table) for t, table in seqs])
    x = model.embed_tokens(ids).detach()
    with torch.inference_mode():
        assert model.native_stack(x.clone(), positions, harness.kv, meta) is not None
        # more rows than the native GEMM takes
        many = x[:1].expand(NATIVE_MAX_ROWS + 1, -1).contiguous()
        assert model.native_stack(many, positions, harness.kv, meta) is None
        # PLAIT_CASCADE=0 selects the plain-torch attention
        monkeypatch.setenv("PLAIT_CASCADE", "0")
        assert model.native_stack(x.clone(), positions, harness.kv, meta) is None
        monkeypatch.delenv("PLAIT_CASCADE")
        # float64 activations (a model in another dtype)
        assert model.native_stack(x.double(), positions, harness.kv, meta) is None
    # weights not packed as panels
    plain = _model(tmp_path / "plain", default_model, "llama", prepack=False)
    with torch.inference_mode():
        assert plain.native_stack(x.clone(), positions, harness.kv, meta) is None
