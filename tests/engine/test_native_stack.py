"""The native whole-stack call (one C call for every layer of a few-row step,
kernels/cpu/decoder.c, `CpuNativeOps.decoder_stack`) against the layer loop through the same
ops table: the same bits, in the hidden states and in every K/V it writes; and not planned
wherever that loop would not be native."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from helpers.engine import prompt
from helpers.model import PagedHarness, load_model
from helpers.tiny_model import make_tiny_model

from plait.engine.models.llama import LlamaForCausalLM
from plait.kernels.cpu import build, native, quant, stack
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.native import STACK_POINTERS

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")

SHARED = 20  # prompt tokens the first four sequences share: 5 blocks of 4


def _model(tmp_path, default_model, model_type: str, **options) -> LlamaForCausalLM:
    path = make_tiny_model(tmp_path / model_type, default_model.path, model_type)
    return load_model(path, 2048, **options)


def _sequences() -> list[tuple[list[int], list[int]]]:
    """(tokens, block table): four sequences on one 20-token prompt (its 5 blocks shared, as
    n choices are), then two alone."""
    base = prompt(0, SHARED)
    seqs = [(base + prompt(1 + i, 3 + i), [0, 1, 2, 3, 4, 10 + 2 * i, 11 + 2 * i])
            for i in range(4)]
    seqs += [(prompt(10 + i, 9 + 2 * i), [30 + 4 * i + b for b in range(4)]) for i in range(2)]
    return seqs


def _prefilled(model: LlamaForCausalLM,
               kv_dtype: torch.dtype = torch.float32) -> PagedHarness:
    """Every sequence's tokens but its last in the cache (the shared prompt computed once),
    a cache of `kv_dtype`."""
    harness = PagedHarness(model.config, num_blocks=48, block_size=4, kv_dtype=kv_dtype)
    seqs = _sequences()
    harness.run(model, [(seqs[0][0][:-1], 0, seqs[0][1])])
    harness.run(model, [(t[:-1], SHARED, table) for t, table in seqs[1:4]])
    harness.run(model, [(t[:-1], 0, table) for t, table in seqs[4:]])
    return harness


def _last_tokens(harness: PagedHarness):
    """(ids, positions, unplanned metadata) of a decode step: every sequence's last token."""
    return harness.step([(t, len(t) - 1, table) for t, table in _sequences()])


def _both(model: LlamaForCausalLM, harness: PagedHarness, ids, positions, meta):
    """(native stack's hidden states and caches, the layer loop's)."""
    kv_stack, kv_loop = copy.deepcopy(harness.kv), copy.deepcopy(harness.kv)
    stacked = harness.forward(model, ids, positions, meta, kv_stack)
    assert meta.whole_stack and model.stack is not None  # the plan chose the stack
    looped = harness.forward(model, ids, positions, meta, kv_loop, whole_stack=False)
    return (stacked, kv_stack), (looped, kv_loop)


def _same_caches(kv: list, kv_ref: list) -> None:
    for (k, v), (k_ref, v_ref) in zip(kv, kv_ref, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize(("model_type", "kv_dtype"), [
    ("llama", torch.float32), ("qwen2", torch.float32),  # qwen2: a q|k|v bias
    ("llama", torch.bfloat16),  # --kv-cache-dtype bfloat16
    ("qwen2", torch.bfloat16)])  # and keys stored less the layers' key offsets
def test_decode_step_is_the_layer_loop_bit_for_bit(tmp_path, default_model, model_type,
                                                   kv_dtype) -> None:
    """Six decode rows in an order that interleaves the shared group with rows alone, so
    the attention's chunk order differs from the token order; the caches float32 or
    bfloat16 (the stack writes and reads them as the loop's kernels do)."""
    model = _model(tmp_path, default_model, model_type)
    harness = _prefilled(model, kv_dtype)
    seqs = _sequences()
    order = [4, 0, 1, 5, 2, 3]
    ids, positions, meta = harness.step([(seqs[i][0], len(seqs[i][0]) - 1, seqs[i][1])
                                         for i in order])
    (stacked, kv_stack), (looped, kv_loop) = _both(model, harness, ids, positions, meta)
    assert model.stack is not None and model.stack.kv_dtype == native.KV_DTYPES[kv_dtype]
    offsets = model.stack.layers[:, STACK_POINTERS.index("k_offset")]
    assert bool((offsets != 0).all()) == (model_type == "qwen2" and kv_dtype == torch.bfloat16)
    assert stacked is not None and stacked.shape == (6, model.config.hidden_size)
    assert torch.equal(stacked, looped)
    _same_caches(kv_stack, kv_loop)
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
    _same_caches(kv_stack, kv_loop)


def test_not_planned_where_the_loop_is_not_all_native(tmp_path, default_model) -> None:
    model = _model(tmp_path, default_model, "llama")
    harness = _prefilled(model)
    _, positions, meta = _last_tokens(harness)
    model.bind(harness.kv)
    assert model.stack is not None and model.ops.plan(meta, positions).whole_stack
    # more rows than the native GEMM takes: a prefill of NATIVE_MAX_ROWS + 1 tokens
    long = prompt(50, NATIVE_MAX_ROWS + 1)
    _, positions, meta = harness.step([(long, 0, list(range(40, 47)))])
    assert not model.ops.plan(meta, positions).whole_stack
    # cascade attention off: the plain-torch attention, so no whole stack
    plain_attention = _model(tmp_path / "nocascade", default_model, "llama", cascade=False)
    assert plain_attention.ops.stack_rows == 0
    plain_attention.bind(harness.kv)
    assert plain_attention.stack is None
    # weights not in native panels
    unpacked = _model(tmp_path / "plain", default_model, "llama", convert=False)
    unpacked.bind(harness.kv)
    assert unpacked.stack is None
    # the native kernels off: the torch ops table, which runs no whole stack
    torch_ops = _model(tmp_path / "torch", default_model, "llama", native=False)
    assert torch_ops.ops.name == "torch" and torch_ops.ops.stack_rows == 0


def test_quantized_descriptors_through_the_stack(tmp_path, default_model) -> None:
    """decoder.c with Q8_0 / Q4_1 / Q5_0 weight descriptors (plait_qgemm) against the same
    stack over float32 panels of those weights' exact dequantization: the same numbers up
    to float32 summation order, in the hidden states and in the K/V written."""
    model = _model(tmp_path, default_model, "qwen2")  # q|k|v with a bias
    types = (quant.Q8_0, quant.Q4_1, quant.Q5_0, quant.Q8_0)  # qkv, o, gate_up, down
    weights = []
    for layer in model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        for lin, ggml_type in zip(linears, types, strict=True):
            blocks = quantize(lin.weight.detach().numpy(), GGMLQuantizationType(ggml_type))
            part = quant.QuantPart(torch.from_numpy(blocks), ggml_type, lin.out_features)
            weight = quant.QuantWeight.build([part], lin.in_features)
            with torch.no_grad():  # the float weights become exactly the quantized ones
                lin.weight.copy_(quant.dequantize_reference(weight))
            lin.select(lin.product)  # its row packs the new weights again
            weights.append(weight)
    harness = _prefilled(model)
    ids, positions, meta = _last_tokens(harness)
    kv_float, kv_quant = copy.deepcopy(harness.kv), copy.deepcopy(harness.kv)
    floats = harness.forward(model, ids, positions, meta, kv_float)
    model.bind(kv_quant)
    stack = model.stack
    assert stack is not None
    layers = stack.layers.clone()
    columns = [STACK_POINTERS.index(n) for n in ("qkv_weight", "o_weight", "gate_up_weight",
                                                 "down_weight")]
    for i, weight in enumerate(weights):
        layers[i // 4, columns[i % 4]] = weight.desc.data_ptr()
    model.stack = dataclasses.replace(stack, layers=layers, tensors=(*stack.tensors, *(
        t for w in weights for t in (w.desc, *(p.data for p in w.parts)))))
    planned = model.ops.plan(meta, positions)
    assert planned.whole_stack
    with torch.inference_mode():
        quantized = model(ids, positions, planned)
    assert torch.allclose(quantized, floats, rtol=1e-4, atol=1e-4)
    assert not torch.equal(quantized, floats)  # the blocks were read: another summation order
    for (k, v), (k_ref, v_ref) in zip(kv_quant, kv_float, strict=True):
        assert torch.allclose(k, k_ref, rtol=1e-4, atol=1e-4)
        assert torch.allclose(v, v_ref, rtol=1e-4, atol=1e-4)


def test_kept_rows_run_all_but_the_last_layer_in_the_stack(tmp_path, default_model,
                                                          monkeypatch) -> None:
    """A step that keeps some rows (`meta.keep`: a prompt chunk's sampled row) runs every
    layer but the last in the stack (`num_layers`: the stream and the last MLP output, no
    final norm), the last pruned in the loop: the layer loop's bits for the kept rows, and
    its K/V for every row."""
    model = _model(tmp_path, default_model, "qwen2")
    harness = _prefilled(model)
    ids, positions, meta = _last_tokens(harness)
    meta.keep = torch.tensor([1, 4])
    layers: list[int | None] = []
    run = stack.decoder_stack

    def spy(*args: object, **kwargs: object) -> object:
        layers.append(kwargs["num_layers"])  # type: ignore[arg-type]
        return run(*args, **kwargs)

    monkeypatch.setattr(stack, "decoder_stack", spy)
    (stacked, kv_stack), (looped, kv_loop) = _both(model, harness, ids, positions, meta)
    assert layers == [model.config.num_layers - 1]
    assert stacked.shape == (2, model.config.hidden_size) and torch.equal(stacked, looped)
    _same_caches(kv_stack, kv_loop)


def test_num_layers_is_checked(tmp_path, default_model) -> None:
    model = _model(tmp_path, default_model, "llama")
    harness = _prefilled(model)
    ids, positions, meta = _last_tokens(harness)
    model.bind(harness.kv)
    meta = model.ops.plan(meta, positions)
    assert model.stack is not None
    x = model.embed_tokens(ids).detach().contiguous()
    for bad in (0, model.config.num_layers + 1):
        with pytest.raises(ValueError, match="num_layers must be in"):
            model.ops.decoder_stack(model.stack, x, positions, meta, bad)


def test_a_stack_of_any_rows_projections_takes_a_prompt(tmp_path, default_model) -> None:
    """The stack's row bound: NATIVE_MAX_ROWS where a projection's row computes more rows
    with another kernel (float32 panels: BLAS), else as many as its buffers' STACK_BYTES
    hold; the ops table plans whole stacks up to it once the model binds it."""
    model = _model(tmp_path, default_model, "llama")
    harness = _prefilled(model)
    model.bind(harness.kv)
    assert model.stack is not None and model.stack.max_rows == NATIVE_MAX_ROWS
    assert model.ops.stack_rows == NATIVE_MAX_ROWS
    shape = model.stack.shape
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    floats = 2 * shape.hidden + 2 * q + 2 * kv + 3 * shape.intermediate
    assert stack.stack_rows(shape) == max(NATIVE_MAX_ROWS, stack.STACK_BYTES // (4 * floats))
    huge = dataclasses.replace(shape, intermediate=stack.STACK_BYTES)
    assert stack.stack_rows(huge) == NATIVE_MAX_ROWS
    layers = [stack.StackLayer(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        qkv=dataclasses.replace(layer.self_attn.qkv_proj.stack_weight(), any_rows=True),
        qkv_bias=None, o=dataclasses.replace(layer.self_attn.o_proj.stack_weight(), any_rows=True),
        gate_up=dataclasses.replace(layer.mlp.gate_up_proj.stack_weight(), any_rows=True),
        down=dataclasses.replace(layer.mlp.down_proj.stack_weight(), any_rows=i > 0),
        extra_bias=False, k_cache=k, v_cache=v)
        for i, (layer, (k, v)) in enumerate(zip(model.layers, harness.kv, strict=True))]
    args = (shape, model.norm.weight.detach(), model.cos_sin, 0.5, torch.float32)
    mixed = stack.gather_stack(layers, *args)
    assert mixed is not None and mixed.max_rows == NATIVE_MAX_ROWS  # one layer's down: 24
    layers[0] = dataclasses.replace(layers[0], down=dataclasses.replace(layers[0].down,
                                                                         any_rows=True))
    every = stack.gather_stack(layers, *args)
    assert every is not None and every.max_rows == stack.stack_rows(shape) > NATIVE_MAX_ROWS
    model.ops.bind_stack(every)
    long = prompt(50, NATIVE_MAX_ROWS + 1)
    _, positions, meta = harness.step([(long, 0, list(range(40, 47)))])
    assert model.ops.plan(meta, positions).whole_stack
