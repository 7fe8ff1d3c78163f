"""A live request's output, token by token: what the core keeps of it beside the
scheduler's `Request` (`OutputState`), the stop checks, and the delta each sampled token
makes (`token_delta`). The core (core.py) counts the token and, when the delta finishes
the request, forgets it and frees its blocks."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from plait.engine.detokenizer import IncrementalDetokenizer
from plait.engine.outputs import RequestDelta, TokenLogprob
from plait.engine.request import Request


@dataclass(slots=True)
class OutputState:
    """What the core keeps of a live request for its output, beside the scheduler's
    `Request`: the incremental detokenizer (text and stop strings) and, when
    `params.prompt_logprobs` is set, the prompt's logprobs, filled chunk by chunk."""

    detokenizer: IncrementalDetokenizer
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)


def stop_check(req: Request, token_id: int, eos_token_ids: Collection[int],
               max_model_len: int) -> tuple[str | None, str | int | None]:
    """(finish reason, stop reason) once `token_id` is `req`'s last output token: "stop"
    for EOS (unless `ignore_eos`) or a stop token id (the id as the stop reason), from
    `min_tokens` on; "length" at `max_tokens` or the context's end; (None, None) else.
    Stop strings are the detokenizer's."""
    params = req.params
    num_out = len(req.output_token_ids)
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
    if num_out >= req.max_tokens or req.num_tokens >= max_model_len:
        return "length", None
    return None, None


def token_delta(req: Request, output: OutputState, token_id: int,
                logprob: TokenLogprob | None, eos_token_ids: Collection[int],
                max_model_len: int, grammar_ended: bool = False) -> RequestDelta:
    """Append one sampled token to `req` and return its delta: the token, its text, its
    logprob when asked, the prompt's logprobs with the first token, and the finish and
    stop reasons when it ends the request. `grammar_ended`: the request's grammar is
    complete with this token, so it stops (even below min_tokens or with ignore_eos: the
    grammar wins); the token's text is kept unless it is EOS. A stop token (EOS or a stop
    token id) ends the text without its own text unless `include_stop_str_in_output`."""
    params = req.params
    first = not req.output_token_ids
    req.output_token_ids.append(token_id)
    reason, stop_reason = stop_check(req, token_id, eos_token_ids, max_model_len)
    hide = reason == "stop" and not params.include_stop_str_in_output
    if grammar_ended and reason != "stop":
        reason, stop_reason = "stop", None
        hide = token_id in eos_token_ids and not params.include_stop_str_in_output
    # Below min_tokens a stop string cannot end the request either (as vLLM).
    step = output.detokenizer.step([] if hide else [token_id], finished=reason is not None,
                                   match_stops=len(req.output_token_ids) >= params.min_tokens)
    if step.stop_str is not None:
        reason, stop_reason = "stop", step.stop_str
    delta = RequestDelta(
        req.request_id, token_ids=[token_id], text=step.text,
        logprobs=[logprob] if logprob is not None and params.logprobs is not None else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens or 0)
    if first and req.needs_prompt_logprobs:
        delta.prompt_logprobs = output.prompt_logprobs
    if reason is not None:
        delta.finish_reason, delta.stop_reason = reason, stop_reason
    return delta


__all__ = ["OutputState", "stop_check", "token_delta"]
