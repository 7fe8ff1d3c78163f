"""vLLM's extension parameters on the OpenAI endpoints, in vLLM's wire shapes.

    prompt_logprobs=k (0..20; with stream only 0)   chat: "prompt_logprobs" at the top level;
        completions: "prompt_logprobs" in each choice. One entry per prompt token, the first
        null (nothing precedes it):
            [null, {"13": {"logprob": -2.25, "rank": 3, "decoded_token": " the"}, ...}, ...]
        each maps the prompt token (ranked in the whole vocabulary) and then its k most
        likely alternatives (ranks 1..k) to their logprobs. For n > 1 the prompt is scored
        once and every choice gets the scores (engine/prompt_share.py).
    return_token_ids                                  chat: "prompt_token_ids" at the top
        level (streaming: on each role chunk) and "token_ids" in each choice (streaming: in
        each content chunk, [] in finish chunks); completions: "prompt_token_ids" and
        "token_ids" in each choice (streaming: prompt ids in the first chunk of a choice).
        Output ids include a stop token the text leaves out (e.g. EOS).
    stream_options.continuous_usage_stats            each chunk with a choice carries
        "usage": {prompt_tokens, completion_tokens, total_tokens} of that choice so far
        (vLLM's per-choice counts); the final usage chunk is unchanged.

Every key appears only when its parameter asked for it, so other responses keep OpenAI's
shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.engine import TokenLogprob, TokenTextTable
from plait.server.errors import bad_request
from plait.server.logprobs import finite
from plait.server.protocol import SamplingRequest


def returned_prompt_logprobs(request: SamplingRequest) -> int | None:
    """The `prompt_logprobs` the response returns (None: none). vLLM's rule: a stream
    cannot carry them, so `prompt_logprobs` > 0 with `stream` is a 400 (0 is accepted and
    returns nothing)."""
    k = request.prompt_logprobs
    if k is None:
        return None
    if request.streaming:
        if k > 0:
            raise bad_request("'prompt_logprobs' are not available when 'stream' is enabled.",
                              "prompt_logprobs", "invalid_value")
        return None
    return k


@dataclass(frozen=True, slots=True)
class Extras:
    """What one request asked of the extras, for building its response or stream."""

    include_usage: bool = False  # a final usage chunk (stream)
    continuous_usage: bool = False  # usage on every chunk (stream)
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # top alternatives per returned prompt entry

    @classmethod
    def of(cls, request: SamplingRequest) -> Extras:
        return cls(request.include_usage, request.continuous_usage,
                   bool(request.return_token_ids), returned_prompt_logprobs(request))

    def usage_tail(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The `usage` key of a stream chunk that carries a choice."""
        if self.continuous_usage:
            return {"usage": {"prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}}
        return {"usage": None} if self.include_usage else {}

    def token_ids(self, key: str, ids: list[int]) -> dict[str, Any]:
        """`{key: ids}` when return_token_ids is on, else nothing."""
        return {key: list(ids)} if self.return_token_ids else {}

    def prompt_logprobs_of(self, table: TokenTextTable,
                           entries: list[TokenLogprob | None] | None) -> dict[str, Any]:
        """`{"prompt_logprobs": [...]}` when asked for, else nothing."""
        if self.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(table, entries or [],
                                                        self.prompt_logprobs)}


def prompt_logprobs_json(table: TokenTextTable, entries: list[TokenLogprob | None],
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt logprobs: per position, token id (a string key, as JSON has it) ->
    {logprob, rank, decoded_token}; the prompt token first, then the top `num_top`."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        scored = {str(entry.token_id): _logprob(table, entry.token_id, entry.logprob,
                                                entry.rank)}
        for rank, (token_id, value) in enumerate(entry.top[:num_top], start=1):
            scored.setdefault(str(token_id), _logprob(table, token_id, value, rank))
        result.append(scored)
    return result


def _logprob(table: TokenTextTable, token_id: int, value: float,
             rank: int | None) -> dict[str, Any]:
    return {"logprob": finite(value), "rank": rank, "decoded_token": table.text(token_id)}


def truncated(request: SamplingRequest, token_ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens=k` (-1: the model's context length) and
    `truncation_side` ("left", the default: keep the last k prompt tokens; "right": the
    first k). Prompts of k tokens or fewer are unchanged; k above the context is a 400."""
    k = request.truncate_prompt_tokens
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                          f"({max_model_len}). Please request a smaller truncation size.",
                          "truncate_prompt_tokens", "invalid_value")
    if len(token_ids) <= k:
        return token_ids
    if request.truncation_side == "right":
        return token_ids[:k]
    return token_ids[len(token_ids) - k:]
