"""Per-token text and bytes, as the OpenAI logprobs objects show them (`token`, `bytes`)."""

from __future__ import annotations

import builtins  # the class below has a method named `bytes`
import json
import re
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback pieces
_METASPACE = "\u2581"  # sentencepiece's visible space "▁"


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: each byte-level vocab char -> its byte.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100.. in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer) -> bool:
    """True when the tokenizer's decoder is (or contains) a byte-level decoder."""
    if getattr(tokenizer, "byte_decoder", None):  # slow GPT-2 style tokenizers
        return True
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if isinstance(state, dict) else []
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def decode_ids(tokenizer: PreTrainedTokenizerBase, token_ids: list[int],
               skip_special_tokens: bool = False, **kwargs: bool) -> str:
    """`tokenizer.decode` of one flat list of ids, which is a str (transformers types every
    `decode` as `str | list[str]`, the list for a batch of lists)."""
    return tokenizer.decode(  # type: ignore[return-value]
        token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


class TokenTextTable:
    """Lazily cached text and exact bytes of single tokens, for logprobs in HTTP responses.

    `bytes(id)` is the token's exact UTF-8 byte string: for byte-level BPE the vocab string is
    mapped back through the GPT-2 byte table, so a token holding part of an emoji gives its
    raw bytes. `text(id)` is those bytes decoded with U+FFFD for an incomplete character
    (e.g. " hello" for "Ġhello"; "\ufffd" for a partial emoji). Special and added tokens give
    their literal content ("<|im_end|>"). Other tokenizers: sentencepiece byte-fallback
    pieces ("<0xF0>") give their byte, "▁" is a space, anything else is `decode([id])`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = {token_id: str(token) for token_id, token in added.items()}
        self._bytes: dict[int, builtins.bytes] = {}
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The token's own text (real spaces, U+FFFD for an incomplete UTF-8 character)."""
        text = self._text.get(token_id)
        if text is None:
            text = self._raw_bytes(token_id).decode("utf-8", errors="replace")
            self._text[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's exact UTF-8 bytes (a new list on every call)."""
        return list(self._raw_bytes(token_id))

    def _raw_bytes(self, token_id: int) -> builtins.bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._compute_bytes(token_id)
            self._bytes[token_id] = raw
        return raw

    def _compute_bytes(self, token_id: int) -> builtins.bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # None: an id the vocabulary lacks
            return decode_ids(self._tokenizer, [token_id]).encode()
        if self._byte_level:
            table = _unicode_to_byte()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if _METASPACE in piece:
            return piece.replace(_METASPACE, " ").encode()
        return decode_ids(self._tokenizer, [token_id]).encode()
