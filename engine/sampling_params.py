"""Per-request sampling parameters (one engine sub-request = one sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.engine.structured import StructuredSpec


class InvalidParamError(ValueError):
    """A request parameter is out of range. `param` names the offending field, `code` is
    the OpenAI error code to report with it (None: none)."""

    def __init__(self, param: str, message: str, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one sequence.

    `n` is a fan-out count used by the offline `LLM` API and the HTTP layer: the engine
    itself only ever sees `n == 1` sub-requests (see `fan_out`). `seed=None` means
    non-reproducible sampling. `logprobs=None` means none; `logprobs=k` (0..20) returns the
    sampled token's logprob plus the top-k alternatives. `prompt_logprobs=k` asks for
    logprobs of every prompt token (used by completions `echo` + `logprobs`). `structured`
    constrains the output to a grammar (each sub-request gets its own matcher). Below
    `min_tokens` generated tokens nothing stops the sequence: EOS and `stop_token_ids` are
    masked, and a `stop` string must end in the text of token `min_tokens` or later (vLLM).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only these (vLLM); None: any
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output must match this (engine/structured.py); None: unconstrained.
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidParamError` for any out-of-range value."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (0.0 <= self.temperature <= 2.0, "temperature",
             f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 1 or self.top_k == 0, "top_k",
             f"top_k must be a positive integer or 0 (disabled), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParamError(param, message)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidParamError("allowed_token_ids",
                                    "allowed_token_ids must contain at least one token id")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise InvalidParamError(
                        "logit_bias", f"logit_bias value for token {token_id} must be in "
                        f"[-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """The params of fan-out sub-request `index`: n=1 and seed+index when seeded."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, stop=list(self.stop),
                       stop_token_ids=list(self.stop_token_ids))
