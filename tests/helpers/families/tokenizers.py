"""The tokenizers the tiny family checkpoints are saved with.

    "smollm2"    the SmolLM2 tokenizer (49,152 tokens, GPT-2 style byte-level BPE), read once
                 from the embedded default model's GGUF with transformers; llama.cpp's
                 converter recognises its pre-tokenizer hash as `smollm`
    "spm-gemma"  a 1,024-piece SentencePiece BPE model (tokenizer.model) with Gemma's ids
                 (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4), no dummy prefix,
                 + GemmaTokenizer
    "spm-llama"  the same text and size with Llama's ids (<unk> 0, <s> 1, </s> 2), a dummy
                 prefix, + LlamaTokenizer (what Phi-3 ships)

The SentencePiece models are trained with sentencepiece's own trainer on the GPL-3 text that
Debian ships (/usr/share/common-licenses/GPL-3), single-threaded and unshuffled, so the same
inputs give the same bytes. llama.cpp's converter reads tokenizer.model for gemma2 and phi3
(and for gemma3 when the file is there); transformers reads the tokenizer.json that its
GemmaTokenizer / LlamaTokenizer write from that model (this needs `protobuf`), and the two
agree on every piece id. One known difference: the Llama-style HF tokenizer encodes a text
that starts with two spaces differently from sentencepiece (its dummy-prefix handling).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from plait.engine.model_loader import default_gguf_path

LICENSE_TEXT = Path("/usr/share/common-licenses/GPL-3")
SPM_VOCAB = 1024

# kind -> (sentencepiece trainer ids and pieces, add_dummy_prefix, transformers class name)
_SPM_KINDS: dict[str, tuple[dict[str, object], bool, str]] = {
    # <mask> at 4 as in Gemma's own vocabulary (GemmaTokenizer adds one past the end otherwise)
    "spm-gemma": (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                       eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                       user_defined_symbols=["<mask>"]),
                  False, "GemmaTokenizer"),
    "spm-llama": (dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), True, "LlamaTokenizer"),
}


def tokenizer_identity(kind: str) -> str:
    """16 hex digits naming tokenizer `kind`'s files: its source file's identity and, for a
    SentencePiece kind, the trainer's settings."""
    if kind == "smollm2":
        source = file_key(default_gguf_path())
    elif kind in _SPM_KINDS:
        source = json.dumps([file_key(LICENSE_TEXT), SPM_VOCAB, _SPM_KINDS[kind]],
                            sort_keys=True)
    else:
        raise KeyError(f"unknown tokenizer {kind!r}")
    return hashlib.sha256(f"{kind}:{source}".encode()).hexdigest()[:16]


def write_tokenizer(kind: str, out_dir: Path, cache: Path) -> None:
    """Write tokenizer `kind`'s files into `out_dir`, building them once under `cache`."""
    source = build_once(cache / f"tokenizer-{kind}-{tokenizer_identity(kind)}", _BUILDERS[kind])
    for item in source.iterdir():
        shutil.copy(item, out_dir / item.name)


def file_key(path: Path) -> str:
    """A cheap identity of a file: 16 hex digits of its name, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def train_spm(kind: str) -> bytes:
    """The serialized SentencePiece model of `kind` (deterministic for a given text)."""
    import sentencepiece as spm

    ids, dummy_prefix, _ = _SPM_KINDS[kind]
    buf = io.BytesIO()
    lines = LICENSE_TEXT.read_text().splitlines()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=SPM_VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        num_threads=1, shuffle_input_sentence=False, input_sentence_size=0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, allow_whitespace_only_pieces=True, minloglevel=2,
        **ids)
    return buf.getvalue()


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, unless it exists built by `build(staging)` in a sibling folder and renamed
    (so a concurrent reader never sees a half-written folder; the first rename wins)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:  # another process renamed its copy first
            if not target.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_smollm2(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _spm_builder(kind: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import transformers

        (out / "tokenizer.model").write_bytes(train_spm(kind))
        cls = getattr(transformers, _SPM_KINDS[kind][2])
        tokenizer = cls.from_pretrained(out)
        if len(tokenizer) != SPM_VOCAB:  # a special token missing from the model was added
            raise RuntimeError(f"{kind}: {len(tokenizer)} tokens, expected {SPM_VOCAB}")
        tokenizer.save_pretrained(out)
        config_file = out / "tokenizer_config.json"  # drop the staging path it records
        config = json.loads(config_file.read_text())
        config.pop("vocab_file", None)
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    return build


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "smollm2": _build_smollm2, **{kind: _spm_builder(kind) for kind in _SPM_KINDS}}
