"""The engine's text view of a tokenizer: token ids to text, as `tokenizer.decode` gives it,
without the tokenizer.

A Hugging Face fast tokenizer holds its whole BPE model (vocabulary maps, merges, regexes):
about 130 MB of heap for Qwen2's 151936 tokens. The engine only ever turns ids into text
(detokenizing, stop strings), so `plait serve`'s API process, which has loaded the
tokenizer anyway, builds a `Vocabulary` from it (`Vocabulary.from_tokenizer`) and hands it
to the engine process with its start arguments; the engine loads the full tokenizer only
when something needs more (a structured-output grammar, a draft model's vocabulary check).

`Vocabulary.decode(ids, skip_special_tokens)` equals the tokenizer's own
`decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`, which is the
`tokenizers` library's: the token strings (ids it does not know dropped; special tokens
dropped when skipping) go through the tokenizer's decoder. Two decoders are reproduced, the
two every supported model family uses; any other tokenizer gives None and the engine keeps
the tokenizer itself (`TokenizerText`):

    "byte_level"     GPT-2's byte-level BPE (SmolLM2, Qwen2): each character of a token
                     string stands for one byte (the inverse of `bytes_to_unicode`; a token
                     with any other character, an added token, stands for its UTF-8 bytes);
                     the text is all the bytes decoded with U+FFFD for invalid sequences.
    "byte_fallback"  sentencepiece-style BPE (llama, mistral, gemma): "▁" is a space,
                     "<0xHH>" pieces are one byte each (a run of them that is not valid UTF-8
                     gives one U+FFFD per byte), the rest is the token string; then up to
                     `strip_start` leading spaces are stripped from the whole text (the
                     decoder's `Strip`, which llama's tokenizers have and gemma's do not).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from plait.engine.token_text import _BYTE_FALLBACK, _METASPACE, _unicode_to_byte, decode_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DECODER_KINDS = ("byte_level", "byte_fallback")
_REPLACEMENT = "\ufffd"


class TextDecoder(Protocol):
    """What the engine needs of a tokenizer: token ids to text, and its own
    end-of-sequence id (None if it has none)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Every token's text piece, enough to decode ids exactly as the tokenizer does.

    `pieces[id]` is the token's piece (None: an id the tokenizer does not know). For
    "byte_level" a piece is a str of characters below U+0100, one per byte; for
    "byte_fallback" it is the token string with "▁" as a space (a "<0xHH>" piece is
    listed in `byte_ids`, id -> its byte). `special_ids`: the ids `skip_special_tokens`
    drops. `eos_token_id`: the tokenizer's own end-of-sequence id, if it has one.
    Plain fields only: it crosses to the engine process in `EngineStart` (wire.py)."""

    kind: str
    pieces: list[str | None]
    special_ids: frozenset[int]
    byte_ids: dict[int, int]
    strip_start: int = 0
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DECODER_KINDS:
            raise ValueError(f"vocabulary kind must be one of {DECODER_KINDS}, "
                             f"not {self.kind!r}")
        if self.strip_start < 0:
            raise ValueError("strip_start must be >= 0")

    @property
    def size(self) -> int:
        """Ids 0..size-1 may have a piece; larger ids decode to nothing."""
        return len(self.pieces)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> Vocabulary | None:
        """The vocabulary of a fast tokenizer whose decoder is one of `DECODER_KINDS`;
        None for any other tokenizer (a slow one, another decoder)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if backend is None or decoder is None:
            return None
        kind, strip_start = _decoder_kind(json.loads(decoder.__getstate__()))
        if kind is None:
            return None
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        # One id at a time: `get_vocab()`'s dict of every token, built and freed on the
        # loading thread's heap, left about 7 MB there that no trim gave back (Qwen2).
        tokens: list[str | None] = [backend.id_to_token(i) for i in range(size)]
        special = frozenset(i for i, added_token in added.items() if added_token.special)
        eos = tokenizer_eos(tokenizer)
        if kind == "byte_level":
            pieces = [None if token is None else _byte_level_piece(token) for token in tokens]
            return cls(kind, pieces, special, {}, 0, eos)
        pieces = [None if token is None else token.replace(_METASPACE, " ") for token in tokens]
        byte_ids = {i: int(match.group(1), 16) for i, piece in enumerate(pieces)
                    if piece is not None and (match := _BYTE_FALLBACK.fullmatch(piece))}
        return cls(kind, pieces, special, byte_ids, strip_start, eos)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`, as the tokenizer's `decode` gives it."""
        pieces, size = self.pieces, len(self.pieces)
        skip = self.special_ids if skip_special_tokens else frozenset()
        kept = [i for i in token_ids if 0 <= i < size and pieces[i] is not None and i not in skip]
        if self.kind == "byte_level":
            raw = "".join([pieces[i] for i in kept])  # type: ignore[misc]  # None filtered out
            return raw.encode("latin-1").decode("utf-8", errors="replace")
        return self._decode_byte_fallback(kept)

    def _decode_byte_fallback(self, token_ids: list[int]) -> str:
        parts: list[str] = []
        run = bytearray()  # consecutive byte pieces, decoded together
        for i in token_ids:
            byte = self.byte_ids.get(i)
            if byte is not None:
                run.append(byte)
                continue
            if run:
                parts.append(_byte_run_text(run))
                run.clear()
            parts.append(self.pieces[i])  # type: ignore[arg-type]  # None filtered out
        if run:
            parts.append(_byte_run_text(run))
        text = "".join(parts)
        cut = 0
        while cut < self.strip_start and cut < len(text) and text[cut] == " ":
            cut += 1
        return text[cut:]


class TokenizerText:
    """A `TextDecoder` over the tokenizer itself, for a tokenizer `Vocabulary` cannot
    reproduce."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return tokenizer_eos(self.tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return decode_ids(self.tokenizer, token_ids, skip_special_tokens=skip_special_tokens,
                          clean_up_tokenization_spaces=False)


def tokenizer_eos(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The tokenizer's own end-of-sequence id; None where it has none (or not an int)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> TextDecoder:
    """The tokenizer's `Vocabulary` where one reproduces it, else the tokenizer itself."""
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    return vocabulary if vocabulary is not None else TokenizerText(tokenizer)


def _decoder_kind(state: Any) -> tuple[str | None, int]:
    """(kind, strip_start) of a `tokenizers` decoder's JSON state; (None, 0) for a decoder
    `Vocabulary` does not reproduce."""
    if not isinstance(state, dict):
        return None, 0
    parts = state.get("decoders") if state.get("type") == "Sequence" else [state]
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        return None, 0
    types = [p.get("type") for p in parts]
    if types == ["ByteLevel"]:
        return "byte_level", 0
    if types[:3] != ["Replace", "ByteFallback", "Fuse"] or len(types) > 4:
        return None, 0
    replace = parts[0]
    if replace.get("pattern") != {"String": _METASPACE} or replace.get("content") != " ":
        return None, 0
    if len(types) == 3:
        return "byte_fallback", 0
    strip = parts[3]
    start = strip.get("start")
    if types[3] != "Strip" or strip.get("content") != " " or strip.get("stop") != 0 \
            or not isinstance(start, int) or start < 0:
        return None, 0
    return "byte_fallback", start


@cache
def _byte_level_tables() -> tuple[dict[int, int], re.Pattern[str]]:
    """`str.translate`'s table from each byte-level character to the character of its byte,
    and a pattern that finds any character outside the table."""
    table = _unicode_to_byte()
    return ({ord(c): b for c, b in table.items()},
            re.compile("[^" + "".join(re.escape(c) for c in table) + "]"))


def _byte_level_piece(token: str) -> str:
    """A byte-level token's bytes as a str (one character below U+0100 per byte): each
    character's byte, or the token's UTF-8 bytes when a character is not in the table."""
    translation, outside = _byte_level_tables()
    if outside.search(token) is None:
        return token.translate(translation)
    return token.encode().decode("latin-1")


def _byte_run_text(run: bytearray) -> str:
    """A run of byte pieces: its UTF-8 text, or one U+FFFD per byte when it is not valid."""
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return _REPLACEMENT * len(run)
