"""The default GGUF served in its own format (`--weights auto`): what is kept, its memory, its
embedding against gguf-py's dequantizer, the q/k un-permutation, and greedy parity with
transformers on the same file; `--weights float32` as before; the options' checks. The kept
weights' products: test_quant_linear.py."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.kept import FUSED, cache_without_weights
from helpers.model import PagedHarness, cpu_ops, greedy_reference, load_model, select_rows
from helpers.tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.cli import build_parser, engine_config
from plait.engine import model_loader
from plait.engine.config import EngineConfig
from plait.engine.core import eos_token_ids
from plait.engine.gguf_file import read_gguf
from plait.engine.gguf_weights import load_gguf_weights
from plait.engine.kv_cache import block_bytes, blocks_from_memory
from plait.engine.model_config import ModelConfig, ModelLoadError
from plait.engine.model_loader import default_gguf_path, resolve_model
from plait.engine.model_runner import ModelRunner
from plait.engine.models.linear import Linear, QuantEmbedding, weight_bytes
from plait.engine.models.llama import LlamaForCausalLM
from plait.engine.weights import load_weights
from plait.kernels.cpu import build
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.quant import dequantize_reference, type_name

PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Once upon a time, in a land far, far away, there lived a dragon who"]
NUM_TOKENS = 24


def test_kept_mode_asks_for_no_float32_weights(tmp_path, monkeypatch, default_model) -> None:
    """A GGUF's first resolve writes config + tokenizer only; float32 weights are added to
    the entry when a float32 engine asks for them."""
    calls = []

    def convert(gguf, out_dir, float32_weights=True):
        calls.append(float32_weights)
        cache_without_weights(tmp_path / "staged", default_model.path)
        for file in (tmp_path / "staged" / default_model.path.name).iterdir():
            shutil.move(file, out_dir / file.name)

    def write_float32(gguf, out_dir, hf_config=None):
        calls.append("float32")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_loader, "convert_gguf", convert)
    monkeypatch.setattr(model_loader, "_write_float32", write_float32)
    resolved = resolve_model(None, float32_weights=False)
    assert calls == [False] and resolved.gguf == default_gguf_path()
    assert not (resolved.path / "model.safetensors").exists()
    assert resolve_model(None, float32_weights=False).path == resolved.path
    assert model_loader.ensure_float32_weights(resolved) == resolved.path
    assert calls == [False, "float32"] and (resolved.path / "model.safetensors").exists()


@pytest.fixture(scope="module")
def file_types() -> dict[str, str]:
    reader = gguf.GGUFReader(default_gguf_path())
    return {t.name.removesuffix(".weight"): type_name(int(t.tensor_type))
            for t in reader.tensors}


def test_kept_linears_hold_the_files_types_in_its_size(kept, file_types) -> None:
    model = kept.model
    for i, layer in enumerate(model.layers):
        for name, sources in FUSED.items():
            linear = layer.get_submodule(name)
            assert linear.qweight is not None, (i, name)
            assert linear.qweight.describe() == "+".join(file_types[f"blk.{i}.{s}"]
                                                         for s in sources)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.qweight.describe() == file_types["token_embd"] == "Q8_0"
    assert model.lm_head.qweight is model.embed_tokens.qweight  # tied: one copy
    size = default_gguf_path().stat().st_size
    assert kept.weight_bytes <= 1.1 * size, (kept.weight_bytes, size)


def test_embedding_rows_equal_the_reference(kept) -> None:
    ids = torch.tensor([0, 1, 2, 17, 49151])
    qweight = kept.model.embed_tokens.qweight
    assert torch.equal(kept.model.embed_tokens(ids), dequantize_reference(qweight)[ids])


def _mapped_file(address: int) -> str | None:
    """The file this process maps at `address` (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_the_embedding_stays_file_backed_and_the_layers_are_copied(kept) -> None:
    """The token embeddings' blocks are read in place from the GGUF file (a mapping of
    their own: resident only where rows are read, as llama.cpp's mmap); a layer's blocks
    are copies (anonymous memory, whatever happens to the file)."""
    table = kept.model.embed_tokens.qweight.parts[0].data
    gguf_file = os.path.realpath(default_gguf_path())
    for address in (table.data_ptr(), table.data_ptr() + table.numel() - 1):
        assert _mapped_file(address) == gguf_file
    down = kept.model.layers[0].mlp.down_proj.qweight.parts[0].data
    assert _mapped_file(down.data_ptr()) is None


def test_q_k_unpermuted_as_transformers(kept, default_model) -> None:
    """llama.cpp permuted attn_q/attn_k's rows; the kept blocks, dequantized, equal the
    float32 weights transformers converted from the same file, bit for bit."""
    dense = load_model(default_model.path, convert=False)
    for i in (0, len(dense.layers) - 1):
        for name in FUSED:
            qweight = kept.model.layers[i].get_submodule(name).qweight
            weight = dense.layers[i].get_submodule(name).weight.detach()
            assert torch.equal(dequantize_reference(qweight), weight), (i, name)
    assert torch.equal(dequantize_reference(kept.model.lm_head.qweight),
                       dense.lm_head.weight.detach())


@pytest.fixture(scope="module")
def hf_greedy(default_model, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, transformers' greedy ids) on the default GGUF, as transformers' GGUF
    loader converted it (`test_q_k_unpermuted_as_transformers`: the kept blocks dequantize
    to exactly these weights)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    eos = list(eos_token_ids(default_model, tokenizer.eos_token_id))
    return prompts, greedy_reference(default_model.path, prompts, eos, NUM_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["auto", "float32"])
def test_greedy_tokens_equal_transformers_on_the_gguf(hf_greedy, weights) -> None:
    prompts, expected = hf_greedy
    llm = LLM(weights=weights, num_kv_blocks=64, block_size=16, numerics="exact")
    linear = llm.engine.runner.model.layers[0].mlp.down_proj
    assert (linear.qweight is not None) == (weights == "auto")
    weight_bytes = llm.engine.runner.weight_bytes
    assert llm.engine.info.weight_bytes == llm.engine.stats().model_weight_bytes \
        == weight_bytes
    assert (weight_bytes < default_gguf_path().stat().st_size) == (weights == "auto")
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("options", [{"weights": "float32"}, {"native": False}],
                         ids=["float32", "no-native-kernels"])
def test_float32_weights(default_model, options) -> None:
    """--weights float32, or auto without the native kernels (nothing else computes from
    the kept blocks): every weight dequantized at load."""
    runner = ModelRunner(EngineConfig(num_kv_blocks=16, **options), default_model)
    assert not any(isinstance(m, QuantEmbedding) or getattr(m, "qweight", None) is not None
               for m in runner.model.modules())
    assert runner.weight_bytes > 3 * default_gguf_path().stat().st_size


def test_bad_option_values_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"weights must be one of \('auto', 'float32'\)"):
        EngineConfig(weights="int4")
    with pytest.raises(ValueError, match=r"numerics must be one of .*'bf16'"):
        EngineConfig(numerics="fp8")
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--weights", "int4"])
    args = build_parser({"PLAIT_WEIGHTS": "float32", "PLAIT_NUMERICS": "bf16"}) \
        .parse_args(["serve"])
    config = engine_config(args)
    assert (config.weights, config.numerics) == ("float32", "bf16")


def test_kept_decode_runs_the_native_stack_as_the_layer_loop(default_model, tokenizer) -> None:
    """A decode step of the kept model: the whole-stack native call (its projections read
    as `QuantWeight` descriptors) gives the layer loop's hidden states and caches."""
    if not build.available():
        pytest.skip("no native kernels here")
    model = LlamaForCausalLM(default_model.config, 512, cpu_ops(default_model.config, 4))
    load_gguf_weights(model, default_gguf_path())
    harness = PagedHarness(model.config, num_blocks=32, block_size=4)
    seqs = [(tokenizer.encode(p), [4 * i + b for b in range(8)]) for i, p in enumerate(PROMPTS)]
    harness.run(model, [(ids[:-1], 0, table) for ids, table in seqs])
    ids, positions, meta = harness.step([(ids, len(ids) - 1, table) for ids, table in seqs])
    kv_stack, kv_loop = copy.deepcopy(harness.kv), copy.deepcopy(harness.kv)
    stacked = harness.forward(model, ids, positions, meta, kv_stack)
    assert model.stack is not None and meta.whole_stack
    looped = harness.forward(model, ids, positions, meta, kv_loop, whole_stack=False)
    torch.testing.assert_close(stacked, looped, atol=1e-5, rtol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(kv_stack, kv_loop, strict=True):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # tied head; untied + q|k|v bias
def test_bf16_checkpoint_kept_as_bf16(tmp_path, default_model, model_type) -> None:
    """A bf16 safetensors checkpoint keeps its projections and embedding as raw bf16 (half
    the float32 bytes) and computes what the float32 upcast computes."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path / "f32", default_model.path, model_type)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()},
              str(path / "model.safetensors"))
    cfg = ModelConfig.from_dir(path)
    kept = LlamaForCausalLM(cfg, 512, cpu_ops(cfg, 4))
    load_weights(kept, path, keep=True)
    dense = load_model(path, 512)
    linears = [m for m in kept.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert len(linears) == 4 * cfg.num_layers + 1
    assert {m.qweight.describe() for m in linears} == {"BF16"}
    assert isinstance(kept.embed_tokens, QuantEmbedding)
    assert (kept.lm_head.qweight is kept.embed_tokens.qweight) == cfg.tie_word_embeddings
    assert sum(weight_bytes(kept)) < 0.55 * sum(p.numel() * 4 for p in dense.parameters())
    ids = list(range(100, 100 + NATIVE_MAX_ROWS + 11))
    table = list(range(16))
    for model in (kept, dense):
        select_rows(model)
    got, want = (PagedHarness(cfg, 32).run(m, [(ids, 0, table)])[0] for m in (kept, dense))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# A tiny model written as llama.cpp writes a GGUF: per-tensor types that mix kept parts
# (Q8_0, Q4_0, Q5_0, Q4_1, F16, BF16) with ones dequantized at load (Q5_1, F32).
TINY_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q5_1", "attn_output": "Q5_0",
              "ffn_gate": "F16", "ffn_up": "BF16", "ffn_down": "F32", "token_embd": "Q4_1",
              "output": "Q8_0"}
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    for top, gguf_name in (("embed_tokens.", "token_embd."), ("norm.", "output_norm."),
                           ("lm_head.", "output.")):
        if name.startswith(top):
            return gguf_name + name.removeprefix(top)
    _, i, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{HF_TO_GGUF[module]}.{kind}"


def _write_tiny_gguf(hf_dir: Path, out: Path, arch: str) -> Path:
    """`hf_dir`'s tensors as a GGUF (q/k rows permuted as llama.cpp does for llama), and
    beside it an HF directory of the same tensors as the GGUF's types round them."""
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_dir(hf_dir)
    writer = gguf.GGUFWriter(str(out), arch)
    rounded = {}
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        name = _gguf_name(hf_name)
        values = tensor.float().numpy()
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(name.split(".")[-2])
        if arch == "llama" and heads:  # llama.cpp's convert_hf_to_gguf permute
            values = values.reshape(heads, 2, -1, *values.shape[1:]).swapaxes(1, 2) \
                .reshape(values.shape)
        kind = TINY_TYPES.get(name.split(".")[-2], "F32") if values.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        raw = values if kind == "F32" else quantize(values, qtype)
        writer.add_tensor(name, raw, raw_dtype=None if kind == "F32" else qtype)
        back = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))
        rounded[hf_name] = back.reshape(tensor.shape) if not (arch == "llama" and heads) \
            else back.reshape(heads, -1, 2, *tensor.shape[1:]).transpose(1, 2) \
            .reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref_dir = out.parent / "rounded"
    shutil.copytree(hf_dir, ref_dir)
    save_file({n: t.contiguous() for n, t in rounded.items()}, str(ref_dir / "model.safetensors"))
    return ref_dir


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_gguf_of_mixed_types(tmp_path, default_model, model_type) -> None:
    """Kept parts beside parts dequantized at load (a fused projection with one is a float32
    module), q/k un-permuted for llama only: the logits of the float32 model holding the
    same rounded weights."""
    hf_dir = make_tiny_model(tmp_path / "hf", default_model.path, model_type)
    ref_dir = _write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", model_type)
    cfg = ModelConfig.from_dir(hf_dir)
    model = LlamaForCausalLM(cfg, 512, cpu_ops(cfg, 4))
    load_gguf_weights(model, tmp_path / "tiny.gguf")
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.qweight is None  # v is Q5_1: not kept
    assert layer.self_attn.o_proj.qweight.describe() == "Q5_0"
    assert layer.mlp.gate_up_proj.qweight.describe() == "F16+BF16"
    assert layer.mlp.down_proj.qweight is None  # F32
    assert model.embed_tokens.qweight.describe() == "Q4_1"
    assert (model.lm_head.qweight is model.embed_tokens.qweight) == cfg.tie_word_embeddings
    select_rows(model)
    reference = load_model(ref_dir, 512)
    ids = list(range(200, 200 + NATIVE_MAX_ROWS + 5))
    got, want = (PagedHarness(cfg, 32).run(m, [(ids, 0, list(range(16)))])[0]
                 for m in (model, reference))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tensor_directory_equals_gguf_py(tmp_path, default_model) -> None:
    """read_gguf (header skipped by type, no metadata parsed) finds gguf-py's tensors: the
    same names, types, shapes and bytes."""
    hf_dir = make_tiny_model(tmp_path / "hf", default_model.path, "qwen2")
    _write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", "qwen2")
    for path in (default_gguf_path(), tmp_path / "tiny.gguf"):
        ours = read_gguf(path)
        reader = gguf.GGUFReader(path)
        assert ours.architecture == ("llama" if path == default_gguf_path() else "qwen2")
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            mine = ours.tensors[t.name]
            assert (mine.tensor_type, mine.shape) == (t.tensor_type, tuple(map(int, t.shape)))
            assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8)
                                  .reshape(-1))


def test_a_gguf_of_other_shapes_is_one_clear_error(tmp_path, default_model) -> None:
    """The file's tensors do not fit the config's model: a ModelLoadError naming them."""
    hf_dir = make_tiny_model(tmp_path / "hf", default_model.path, "llama")
    _write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", "llama")
    cfg = ModelConfig.from_dir(hf_dir)
    wider = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)
    model = LlamaForCausalLM(wider, 512, cpu_ops(wider, 4))
    with pytest.raises(ModelLoadError, match=r"tiny.gguf: blk.0.ffn_gate\|blk.0.ffn_up is "
                                             r"\[256, 64\], expected \[512, 64\]"):
        load_gguf_weights(model, tmp_path / "tiny.gguf")


def test_cpu_kv_budget_leaves_room_for_the_weights(kept, caplog) -> None:
    """A KV budget past host memory is cut to what the weights leave (minus 1 GiB)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    block = block_bytes(kept.model_config, kept.block_size, kept.kv_dtype)
    assert blocks_from_memory(EngineConfig(kv_cache_memory_gb=1.0), kept.device, block,
                              kept.weight_bytes) == (1 << 30) // block
    with caplog.at_level("WARNING", logger="plait.engine"):
        num = blocks_from_memory(EngineConfig(kv_cache_memory_gb=host / 2**30), kept.device,
                                 block, kept.weight_bytes)
    assert num == (host - kept.weight_bytes - (1 << 30)) // block
    assert "KV cache cut to" in caplog.text
