"""OpenAI logprob objects from engine `TokenLogprob`s.

Chat (`choices[].logprobs`):
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
     "refusal": null}
Completions (`choices[].logprobs`), parallel arrays:
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{tok: lp}, ...],
     "text_offset": [...]}
`-inf` (a masked token) is sent as -9999.0, OpenAI's "very unlikely", since JSON has no inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from plait.engine import TokenLogprob, TokenTextTable

VERY_UNLIKELY = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else VERY_UNLIKELY


def chat_content(table: TokenTextTable, logprobs: list[TokenLogprob],
                 num_top: int) -> list[dict[str, Any]]:
    """The `content` list for these tokens, each with its `num_top` best alternatives."""
    return [{
        "token": table.text(lp.token_id),
        "logprob": finite(lp.logprob),
        "bytes": table.bytes(lp.token_id),
        "top_logprobs": [{"token": table.text(t), "logprob": finite(v), "bytes": table.bytes(t)}
                         for t, v in lp.top[:num_top]],
    } for lp in logprobs]


@dataclass(slots=True)
class CompletionLogprobs:
    """Accumulates the parallel arrays of a completions `logprobs` object."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, table: TokenTextTable, logprobs: list[TokenLogprob], num_top: int,
            offset: int) -> None:
        """Append generated tokens whose text starts at character `offset` of the text."""
        for lp in logprobs:
            text = table.text(lp.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(finite(lp.logprob))
            self.top_logprobs.append(_top_dict(table, lp, num_top))
            self.text_offset.append(offset)
            offset += len(text)

    def add_prompt(self, table: TokenTextTable, prompt_token_ids: list[int],
                   prompt_logprobs: list[TokenLogprob | None] | None, num_top: int) -> None:
        """Append the echoed prompt (offsets from 0). The first token has no logprob: null
        `token_logprobs` and `top_logprobs` entries, as OpenAI sends."""
        by_position = list(prompt_logprobs or [])
        offset = 0
        for position, token_id in enumerate(prompt_token_ids):
            lp = by_position[position] if position < len(by_position) else None
            text = table.text(token_id)
            self.tokens.append(text)
            self.token_logprobs.append(None if lp is None else finite(lp.logprob))
            self.top_logprobs.append(None if lp is None else _top_dict(table, lp, num_top))
            self.text_offset.append(offset)
            offset += len(text)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def _top_dict(table: TokenTextTable, lp: TokenLogprob, num_top: int) -> dict[str, float]:
    """{token text: logprob} of the top alternatives, plus the sampled token (OpenAI returns
    up to logprobs + 1 entries)."""
    top: dict[str, float] = {}
    for token_id, value in lp.top[:num_top]:
        top.setdefault(table.text(token_id), finite(value))
    top.setdefault(table.text(lp.token_id), finite(lp.logprob))
    return top
