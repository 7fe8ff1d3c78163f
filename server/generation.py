"""Drive one fanned-out generation request: start the sub-requests, merge their deltas,
accumulate each choice, observe metrics, compute usage, abort whatever is left on exit.

    async with gen:               start: FanOut.start -> StreamMerger (or the 503/400)
        await gen.first_ready(t)  error before the first byte -> APIError (a 500 envelope)
        async for choice, delta in gen.deltas():   streaming
        await gen.run_to_end()                     non-streaming
                                  exit, however reached: abort unfinished sub-requests, log

Leaving the `async with` is the one way a generation closes (serving.py owns it; a stream
takes it over, see `serve_generation`); it happens exactly once, a failed start included.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TypedDict

from plait.engine import (
    GRAMMAR_FAILED,
    ChoiceAccumulator,
    RequestDelta,
    RequestStream,
    TokenLogprob,
)
from plait.server.errors import APIError, bad_request, server_error
from plait.server.fanout import FanOut
from plait.server.merge import StreamMerger
from plait.server.params import Plan
from plait.server.prompts import Prompt
from plait.server.state import ServerState

logger = logging.getLogger("plait.server")

class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    """OpenAI's `usage` object of a chat or completion response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


_REFUSAL_REASONS = {"overloaded": "overloaded", "service_unavailable": "unavailable"}


class GenerationError(Exception):
    """A sub-request failed inside the engine (finish_reason "error", or an abort that this
    request did not ask for). The message is safe to show to the client."""


@dataclass(slots=True)
class ChoiceState:
    """One sub-request of the HTTP request: where its choice goes (`slot`, the index before
    best_of ranking; `prompt_idx`), its output so far (`output`, the engine's accumulator:
    text, token ids and logprobs are kept only when asked to, i.e. non-streaming) and its
    token times for the latency metrics."""

    slot: int
    prompt_idx: int
    output: ChoiceAccumulator
    first_token_time: float | None = None
    last_token_time: float | None = None


def _api_error(exc: GenerationError) -> APIError:
    """A 500, except for a grammar the engine could not compile: it came from the client's
    schema or grammar (most are refused up front; a few fail only against the tokenizer),
    so it is a 400."""
    message = str(exc)
    if message.startswith(GRAMMAR_FAILED):
        return bad_request(message.splitlines()[0][:500], None, "invalid_grammar")
    return server_error(message)


def new_completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    """The sub-requests of one HTTP request and their accumulated choices."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[Prompt], plan: Plan,
                 *, keep_output: bool, log_id: str | None = None) -> None:
        self.state = state
        self.request_id = request_id
        self.log_id = log_id
        self.prompts = prompts
        self.plan = plan
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.choices = {
            p * plan.num_samples + j: ChoiceState(p * plan.num_samples + j, p,
                                                  ChoiceAccumulator(keep_output=keep_output))
            for p in range(len(prompts)) for j in range(plan.num_samples)}
        self._fanout = FanOut(state.engine, request_id, state.settings.max_queued_requests)
        self._merger: StreamMerger[int, RequestDelta] | None = None
        self._first: tuple[ChoiceState, RequestDelta] | None = None
        self._outcome = "aborted"
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Generation:
        """Start: admit every sub-request or none, else close and raise the fan-out's
        `APIError` (a 503 is counted in /metrics as overloaded or unavailable)."""
        try:
            self._start()
        except BaseException:
            self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def _start(self) -> None:
        try:
            streams: dict[int, RequestStream] = self._fanout.start(
                [p.token_ids for p in self.prompts], self.plan.params, self.plan.num_samples)
        except APIError as exc:
            reason = _REFUSAL_REASONS.get(exc.code or "")
            if reason is None:  # a 400: this request can never be admitted
                self._outcome = "rejected"
            else:
                self._outcome = "refused"
                self.state.metrics.requests_refused.labels(reason).inc()
            raise
        if self.state.settings.log_prompts:  # admitted requests only: refusals stay cheap
            self._log_prompts()
        self._merger = StreamMerger(streams)
        self.state.metrics.request_n.observe(self.plan.n)

    async def first_ready(self, timeout: float | None) -> None:
        """Wait up to `timeout` for the first delta; raise a 500 `APIError` if it is an
        engine error, so that a failure before the first byte is a normal error response."""
        assert self._merger is not None
        if await self._merger.wait_ready(timeout):
            item = await anext(self._merger, None)
            if item is not None:
                try:
                    self._first = self._apply(*item)
                except GenerationError as exc:
                    self._outcome = "error"
                    raise _api_error(exc) from None

    async def deltas(self) -> AsyncIterator[tuple[ChoiceState, RequestDelta]]:
        """Every delta in arrival order, after it was applied to its choice. Raises
        `GenerationError` on an engine error."""
        assert self._merger is not None
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for slot, delta in self._merger:
            if delta.finish_reason in ("error", "abort") and (delta.token_ids or delta.text):
                # A reader that fell behind gets the failure merged with the tokens before
                # it (RequestStream merges): those tokens go out first, then the failure.
                yield self._apply(slot, replace(delta, finish_reason=None, stop_reason=None,
                                                error=None))
                delta = replace(delta, token_ids=[], text="", prompt_logprobs=None,
                                logprobs=None if delta.logprobs is None else [])
            yield self._apply(slot, delta)
        self._outcome = "ok"

    async def run_to_end(self) -> list[ChoiceState]:
        """Collect everything (non-streaming); engine errors become an `APIError` (500,
        or 400 for a grammar the engine could not compile)."""
        try:
            async for _ in self.deltas():
                pass
        except GenerationError as exc:
            self._outcome = "error"
            raise _api_error(exc) from None
        return [self.choices[slot] for slot in sorted(self.choices)]

    def _close(self) -> None:
        """Abort unfinished sub-requests, stop the merger, record e2e latency and log.
        Only the first call does anything (a failed start closes before any exit)."""
        if self._closed:
            return
        self._closed = True
        if self._merger is not None:
            self._merger.close()
        self._fanout.abort()
        now = time.monotonic()
        if self._outcome == "ok":
            self.state.metrics.e2e_request_latency.observe(now - self.arrival)
        self._log(now)

    # ---------------------------------------------------------------- per delta
    def _apply(self, slot: int, delta: RequestDelta) -> tuple[ChoiceState, RequestDelta]:
        choice = self.choices[slot]
        now = time.monotonic()
        metrics = self.state.metrics
        num_new = len(delta.token_ids)
        if num_new:
            # One inter-token sample per token after a choice's first (coalesced tokens
            # share the gap; those that came with the first token count as 0).
            if choice.first_token_time is None:
                choice.first_token_time = now
                metrics.time_to_first_token.observe(now - self.arrival)
                gaps = [0.0] * (num_new - 1)
            else:
                gaps = [(now - (choice.last_token_time or now)) / num_new] * num_new
            for gap in gaps:
                metrics.inter_token_latency.observe(gap)
            choice.last_token_time = now
        choice.output.add(delta)
        if delta.finish_reason in ("error", "abort"):
            logger.warning("request %s: sub-request %s failed: %s", self.request_id,
                           delta.request_id, delta.error or delta.finish_reason)
            raise GenerationError(delta.error or "The request was aborted by the engine.")
        if delta.finish_reason is not None:
            metrics.request_success.labels(delta.finish_reason).inc()
        return choice, delta

    # ---------------------------------------------------------------- results
    def prompt_choices(self, prompt_idx: int) -> list[ChoiceState]:
        """The choices returned for one prompt: all samples, or the `n` with the highest
        cumulative logprob when best_of > n (best first; ties keep sample order)."""
        num = self.plan.num_samples
        samples = [self.choices[prompt_idx * num + j] for j in range(num)]
        if num == self.plan.n:
            return samples
        ranked = sorted(samples, key=lambda c: -(c.output.cumulative_logprob or 0.0))
        return ranked[: self.plan.n]

    def prompt_logprobs(self, prompt_idx: int) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs (every sample of a prompt gets the same scores)."""
        return next((c.output.prompt_logprobs for c in self.choices.values()
                     if c.prompt_idx == prompt_idx and c.output.prompt_logprobs is not None),
                    None)

    def usage(self) -> Usage:
        """Prompt tokens once per prompt (not per choice); completion tokens of every sample
        generated (best_of candidates included).

        Cached tokens: per prompt, the mean over its samples of the prompt tokens each one
        got from the cache (rounded down), summed over the prompts. The prompt is counted
        once for its n samples, so this is the share of the n prompt reads that the cache
        (or the shared prefill) served, never more than `prompt_tokens`; times n it is (up
        to rounding) what the server's prefix-cache hit counter counts for the request. A
        first n=4 request whose prompt is computed once reports 3/4 of it cached (samples
        2..4 read the shared prefill); a repeat that finds the whole prompt cached reports
        all of it; n=1 reports exactly what its one sample reused."""
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion = 0 if self.plan.discard_output else sum(
            c.output.num_tokens for c in self.choices.values())
        cached_sum = [0] * len(self.prompts)  # one pass: linear in the number of choices
        for c in self.choices.values():
            cached_sum[c.prompt_idx] += c.output.num_cached_tokens
        cached = sum(total // self.plan.num_samples for total in cached_sum)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _log_prompts(self) -> None:
        """Only with --log-prompts: by default the log never holds prompt text."""
        tokenizer = self.state.engine.tokenizer
        for idx, prompt in enumerate(self.prompts):
            text = prompt.text or tokenizer.decode(prompt.token_ids)
            logger.info("request %s (x-request-id %s) prompt %d: %r", self.request_id,
                        self.log_id, idx, text)

    def _log(self, now: float) -> None:
        usage = self.usage()
        reasons: dict[str, int] = {}
        for c in self.choices.values():
            reason = c.output.finish_reason or "none"
            reasons[reason] = reasons.get(reason, 0) + 1
        firsts = [c.first_token_time for c in self.choices.values() if c.first_token_time]
        ttft = f"{min(firsts) - self.arrival:.3f}s" if firsts else "-"
        logger.info(
            "request %s (x-request-id %s) %s: prompts=%d samples=%d prompt_tokens=%d "
            "completion_tokens=%d cached_tokens=%d finish=%s ttft=%s e2e=%.3fs",
            self.request_id, self.log_id, self._outcome, len(self.prompts),
            len(self.choices), usage["prompt_tokens"], usage["completion_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            reasons, ttft, now - self.arrival)
