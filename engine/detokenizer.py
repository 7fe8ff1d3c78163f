"""Incremental detokenization of one sequence, with stop strings.

Token text is decoded with the prefix_offset / read_offset technique (as in HF TGI and vLLM):
decode a short window of previous tokens with and without the new ones and emit the
difference, so leading spaces, merges and multi-token UTF-8 characters come out right.

    window:  [ ...already emitted... | not yet emitted ... ]
             ^prefix_offset          ^read_offset          ^end
    new text = decode(window[prefix:end]) - decode(window[prefix:read])

While the new text ends in U+FFFD (a UTF-8 character split across byte-level tokens), the
offsets stay put and nothing is emitted until a later token completes the character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plait.engine.vocabulary import TextDecoder

# Prompt tokens that seed the decode window, so the first output token's leading space (and
# any merge with the prompt tail) decodes as it would inside the full text.
_NUM_PROMPT_SEED_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerStep:
    """The result of one `IncrementalDetokenizer.step`."""

    text: str  # text safe to emit now (never a possible stop-string prefix, unless finished)
    stop_str: str | None  # set when a stop string matched: the request must finish, "stop"


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas and detects stop strings.

    Created by the engine when a sub-request starts; `step` is called once per engine step
    with the tokens appended since the previous call (usually one). The engine passes
    `finished=True` when it ends the request for another reason (length, EOS, stop token):
    everything held back is then released, including an incomplete UTF-8 tail (as U+FFFD,
    as `tokenizer.decode` would show it). Whether a stop token's own text belongs in the
    output is the engine's choice: it passes the token or leaves it out.

    Stop strings are matched in the decoded text (after `skip_special_tokens`). The earliest
    match wins (ties: the shorter string); the emitted text ends right before it, or right
    after it with `include_stop_str_in_output`. Once a stop string matched, every later call
    returns empty text. A step called with `match_stops=False` (the request is still below
    `min_tokens`, as vLLM) finds no stop string: a match must end in text decoded by a later
    step.
    """

    def __init__(self, text: TextDecoder, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        """`text` decodes ids as the tokenizer does (vocabulary.py)."""
        self._text = text
        self._skip_special = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._window = list(prompt_token_ids[-_NUM_PROMPT_SEED_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        # Decoded text not yet emitted: at most a stop-string prefix between steps. A stop
        # string can never start inside emitted text (it would have been held back), so
        # only this tail is ever searched.
        self._pending = ""
        self._emitted: list[str] = []  # emitted deltas, joined lazily by `output_text`
        self._stopped = False

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stopped

    def step(self, new_token_ids: list[int], finished: bool,
             match_stops: bool = True) -> DetokenizerStep:
        """Decode `new_token_ids` and return the text that may be emitted now."""
        if self._stopped:
            return DetokenizerStep("", None)
        old_len = len(self._pending)
        new_text = [self._decode_next(token_id) for token_id in new_token_ids]
        if finished:
            new_text.append(self._decode_pending(flush=True))
        self._pending += "".join(new_text)
        stop_str, emit_end = self._find_stop(old_len) if match_stops else (None, 0)
        if stop_str is not None:
            self._stopped = True
        elif finished:
            emit_end = len(self._pending)
        else:
            emit_end = len(self._pending) - self._held_back_len()
        delta = self._pending[:emit_end]
        self._pending = "" if self._stopped else self._pending[emit_end:]
        if delta:
            self._emitted.append(delta)
        return DetokenizerStep(delta, stop_str)

    def _decode(self, token_ids: list[int]) -> str:
        return self._text.decode(token_ids, self._skip_special)

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        return self._decode_pending()

    def _decode_pending(self, flush: bool = False) -> str:
        """New text of the tokens after `read_offset`; "" while a character is incomplete."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._window[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) and not flush:
            return ""  # e.g. a skipped special token: nothing to show yet
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        new_text = full_text[len(prefix_text):]
        # Slide the window: the tokens just read become the next prefix; drop older ones.
        del self._window[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._window)
        return new_text

    def _find_stop(self, old_len: int) -> tuple[str | None, int]:
        """Earliest stop string in the pending text, and where the emitted text ends.

        Text up to `old_len` was searched before, so a new match must end after it: each stop
        string is searched only from `old_len - len(stop) + 1` on.
        """
        best: tuple[int, int, str] | None = None  # (start, length, stop)
        for stop in self._stops:
            start = self._pending.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        if best is None:
            return None, 0
        start, length, stop = best
        return stop, start + length if self._include_stop else start

    def _held_back_len(self) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of a stop."""
        tail = self._pending[-self._max_stop_len:] if self._max_stop_len else ""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:k]):
                    held = k
                    break
        return held
