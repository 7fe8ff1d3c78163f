"""`--speculative-config`: which draft proposer runs, and how many tokens it drafts.

The JSON shape and names are vLLM's, e.g.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"method": "draft_model", "model": "/path/to/draft.gguf", "num_speculative_tokens": 4}

A bare method name ("ngram") is the short form: that method with its defaults. Every
error names the field it is about; unknown fields are errors, not ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "suffix", "draft_model")
# ngram's lookup window when neither bound is given (vLLM's default).
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_NGRAM_TOKENS = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """One proposer's settings; built once at startup, validated in `__post_init__`.

    `num_speculative_tokens` (k): the most draft tokens per sequence and step (the step
    then scores k + 1 rows of that sequence). ngram: `prompt_lookup_max` down to
    `prompt_lookup_min` trailing tokens are searched for in the sequence. suffix: vLLM's
    `suffix_decoding_*` knobs (engine/spec/suffix.py). draft_model: `model`, a path the
    target's loader accepts, with the same tokenizer; `draft_vocab_size`, the token ids
    below which its LM head scores every token (the ids past it only where the sequence
    holds them; None: 32768 for vocabularies over 65536, else all; engine/spec/draft_head.py);
    `draft_p_min`, the least probability the draft model gives its own argmax for a draft
    token: a draft ends before the first token the draft model is less sure of (llama.cpp's
    `--draft-p-min`; 0: no cut; engine/spec/draft_model.py); `prompt_lookup_min` /
    `prompt_lookup_max` (not vLLM's: its draft_model takes no lookup), a prompt lookup as
    ngram's tried first, the draft model drafting only where it finds nothing (None for
    both: no lookup); `draft_token_cost`, what drafting one token costs against one decode
    step of the target (policy.py's c: drafts whose recent acceptance, or a target whose
    own confidence, is below it back off; None: the draft's weights' bytes over the
    target's; 0: no back-off for cost).

    `disable_by_batch_size`: speculation steps aside for a step whose decoding sequences
    number at least this many (vLLM's name; None: the measured default in
    engine/spec/policy.py)."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    draft_vocab_size: int | None = None
    draft_p_min: float = 0.0
    draft_token_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative config: method must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, allow_none=True)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, allow_none=True)
        if self.method in ("ngram", "draft_model"):
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, allow_none=True)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, allow_none=True)
            low, high = self.lookup_window
            if low > high:
                raise ValueError(f"speculative config: prompt_lookup_min ({low}) must be <= "
                                 f"prompt_lookup_max ({high})")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative config: prompt_lookup_min/prompt_lookup_max are "
                             f"ngram and draft_model settings, not {self.method!r} ones")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative config: method 'draft_model' needs \"model\" "
                             "(the draft model's path)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative config: \"model\" is a draft_model setting, not "
                             f"a {self.method!r} one")
        _check_int("draft_vocab_size", self.draft_vocab_size, 1, allow_none=True)
        if self.method != "draft_model" and self.draft_vocab_size is not None:
            raise ValueError(f"speculative config: draft_vocab_size is a draft_model "
                             f"setting, not a {self.method!r} one")
        _check_float("draft_p_min", self.draft_p_min, 0.0, 1.0)
        if self.method != "draft_model" and self.draft_p_min:
            raise ValueError(f"speculative config: draft_p_min is a draft_model setting, "
                             f"not a {self.method!r} one")
        if self.draft_token_cost is not None:
            _check_float("draft_token_cost", self.draft_token_cost, 0.0, None)
            if self.method != "draft_model":
                raise ValueError(f"speculative config: draft_token_cost is a draft_model "
                                 f"setting, not a {self.method!r} one")
        if self.method == "suffix":
            _check_int("suffix_decoding_max_tree_depth",
                       self.suffix_decoding_max_tree_depth, 1)
            _check_int("suffix_decoding_max_cached_requests",
                       self.suffix_decoding_max_cached_requests, 0)
            _check_float("suffix_decoding_max_spec_factor",
                         self.suffix_decoding_max_spec_factor, 0.0, None)
            _check_float("suffix_decoding_min_token_prob",
                         self.suffix_decoding_min_token_prob, 0.0, 1.0)

    @property
    def num_tokens(self) -> int:
        """k: `num_speculative_tokens`, or the method's default (ngram 4, suffix the tree
        depth as vLLM, draft_model 4)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.method == "suffix":
            return self.suffix_decoding_max_tree_depth
        return DEFAULT_NGRAM_TOKENS

    @property
    def draft_lookup(self) -> tuple[int, int] | None:
        """draft_model's prompt lookup ahead of the draft model: `lookup_window` where
        `prompt_lookup_min` or `prompt_lookup_max` is given, else None (no lookup)."""
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            return None
        return self.lookup_window

    @property
    def lookup_window(self) -> tuple[int, int]:
        """ngram's (min, max) n, one bound defaulting to the other (vLLM's rule)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
        if low is None:
            assert high is not None
            return high, high
        return low, low if high is None else high

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From `--speculative-config`: a JSON object, or a bare method name. Raises
        ValueError naming the bad field."""
        text = text.strip()
        if not text.startswith(("{", "[", '"')):
            return cls(method=text)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """From a mapping of vLLM's field names; unknown names and wrong types are errors."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        if "method" not in value:
            raise ValueError("speculative config: \"method\" is required "
                             f"({', '.join(SPEC_METHODS)})")
        for name in ("method", "model"):
            item = value.get(name)
            if name in value and not isinstance(item, str) and not (name == "model"
                                                                    and item is None):
                raise ValueError(f"speculative config: {name} must be a string, got {item!r}")
        return cls(**value)

    def to_json(self) -> str:
        """The config as JSON (the fields that differ from their defaults), for logs and
        for the engine process's command."""
        defaults = cls_defaults()
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)
                           if f.name == "method" or getattr(self, f.name) != defaults[f.name]})


def cls_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(SpeculativeConfig)}


def _check_int(name: str, value: object, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"speculative config: {name} must be an integer >= {low}, "
                         f"got {value!r}")


def _check_float(name: str, value: object, low: float, high: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (float(value) < low or (high is not None and float(value) > high)):  # type: ignore[arg-type]
        ok = False
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative config: {name} must be a number {bound}, got {value!r}")
