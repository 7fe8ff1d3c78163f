"""What the engine hands back: per-step deltas of one sub-request, the one accumulator that
folds them into a choice (for the offline `LLM` and the HTTP server alike), and offline
results.

    RequestDelta ... RequestDelta  --ChoiceAccumulator.add-->  text, token ids, logprobs,
                                                               cumulative logprob, finish
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one chosen token plus the top alternatives (descending by logprob).
    `rank` is the token's 1-based rank in its distribution (1: the most likely), where it
    was computed (prompt logprobs), else None."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class RequestDelta:
    """New output of one sub-request since its previous delta.

    Deltas of one request arrive in order; consecutive deltas may be merged (`merge`) when a
    consumer reads slowly, so a delta can carry several tokens. `finish_reason` is set on the
    last delta only: "stop", "length", "abort" or "error" (then `error` says why).
    `stop_reason` is the matched stop string or stop token id, if any.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Logprobs of each prompt token (None for the first one); only on the first delta.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestDelta) -> None:
        """Append `later` (the next delta of the same request) into this one, in place."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.error = later.error or self.error
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice of an offline `LLM.generate` call."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """All `n` choices of one prompt, in index order."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from cache, summed over the choices."""
        return sum(o.num_cached_tokens for o in self.outputs)


@dataclass(slots=True)
class ChoiceAccumulator:
    """One sub-request's output so far, folded from its deltas in arrival order.

    Used by the offline `LLM` (engine/llm.py) and the HTTP layer (server/generation.py),
    so a choice's text, logprobs and cumulative logprob are computed in one place.
    `keep_output=False` (a stream that forwards each delta as it comes) keeps counts,
    the cumulative logprob and the finish only: `text`, `token_ids` and `logprobs` stay
    empty. `logprobs` and `cumulative_logprob` are None until a delta carries logprobs
    (the request asked for none). `finish_reason` is "stop", "length", "abort" or "error"
    (`error` says why), as the engine sent it.
    """

    keep_output: bool = True
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    _text: list[str] = field(default_factory=list)  # joined on read: appends stay linear

    @property
    def text(self) -> str:
        return "".join(self._text)

    def add(self, delta: RequestDelta) -> None:
        """Fold in the next delta of this sub-request (O(size of the delta))."""
        self.num_tokens += len(delta.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.logprobs is not None:
            self.cumulative_logprob = ((self.cumulative_logprob or 0.0)
                                       + sum(lp.logprob for lp in delta.logprobs))
            if self.keep_output:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.keep_output:
            self._text.append(delta.text)
            self.token_ids.extend(delta.token_ids)
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error = delta.error

    def to_output(self, index: int) -> CompletionOutput:
        """The finished choice as `LLM.generate` returns it."""
        return CompletionOutput(index, self.token_ids, self.text, self.finish_reason,
                                self.stop_reason, self.logprobs, self.cumulative_logprob,
                                self.num_cached_tokens)
