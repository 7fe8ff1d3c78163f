"""Request -> `SamplingParams`: defaults, cross-field checks, logit_bias parsing.

Everything a client can get wrong raises `APIError` 400 naming the parameter; the engine's
own range checks (`InvalidParamError`) are mapped the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from plait.engine import InvalidParamError, SamplingParams, StructuredSpec
from plait.server.errors import bad_request, echo
from plait.server.extras import returned_prompt_logprobs
from plait.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI's tokenizer-limited logit_bias
_TOKEN_ID = re.compile(r"^[0-9]+$")


@dataclass(frozen=True, slots=True)
class Plan:
    """How one HTTP request runs on the engine.

    Each prompt is sampled `num_samples` times (n, or best_of) with `params.for_choice(j)`;
    the `n` best (all, when num_samples == n) are returned. `logprobs` is what the client
    asked for (None: nothing); the engine may be asked for more (best_of needs them).
    `discard_output` runs one token and returns none of it (completions max_tokens=0).
    """

    params: SamplingParams
    n: int
    num_samples: int
    logprobs: int | None
    discard_output: bool = False


def check_stream_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.streaming:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is "
                          "enabled.", "stream_options")


def chat_plan(request: ChatCompletionRequest, structured: StructuredSpec | None,
              keep_special: bool = False) -> Plan:
    """The chat request's plan; `structured` is the output constraint its tools or
    response_format need (constrained/output_plan.py), None for none. `keep_special`: a
    tool-call parser reads special tokens, so they stay in the text unless the request's
    `skip_special_tokens` says otherwise."""
    check_stream_options(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("The 'top_logprobs' parameter is only allowed when 'logprobs' is "
                          "enabled.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = build_params(request, max_tokens=max_tokens, logprobs=logprobs,
                          prompt_logprobs=returned_prompt_logprobs(request),
                          structured=structured, skip_special=not keep_special)
    return Plan(params, request.num_choices, request.num_choices, logprobs)


def completion_plan(request: CompletionRequest, structured: StructuredSpec | None) -> Plan:
    """The completion request's plan; `structured` is its response_format's or
    structured_outputs' constraint (constrained/grammars.py), None for none."""
    check_stream_options(request)
    n = request.num_choices
    best_of = request.best_of if request.best_of is not None else n
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be greater than or equal to n ({n}).",
                          "best_of")
    if best_of > n and request.streaming:
        raise bad_request("best_of cannot be used with stream: results cannot be streamed.",
                          "best_of")
    logprobs = request.logprobs
    engine_logprobs = logprobs if best_of == n else (logprobs or 0)
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    discard = max_tokens == 0
    # Scored once for the echoed logprobs and the returned prompt_logprobs: the larger k.
    wanted = [k for k in (logprobs if request.echo else None,
                          returned_prompt_logprobs(request)) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    params = build_params(request, max_tokens=max(max_tokens, 1), logprobs=engine_logprobs,
                          prompt_logprobs=prompt_logprobs, structured=structured)
    return Plan(params, n, best_of, logprobs, discard_output=discard)


def build_params(request: SamplingRequest, *, max_tokens: int | None,
                 logprobs: int | None, prompt_logprobs: int | None = None,
                 structured: StructuredSpec | None = None,
                 skip_special: bool = True) -> SamplingParams:
    """The request's finished sampling parameters, range-checked. Checks against the vocabulary
    (`top_k`, `logit_bias` keys, `stop_token_ids`) are the engine's `validate_request`.
    `skip_special` is the default of the request's `skip_special_tokens`."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token survives, i.e. greedy
        temperature, top_p = 0.0, 1.0
    top_k = request.top_k
    if top_k is not None and top_k in (0, -1):  # vLLM spellings of "disabled"
        top_k = None
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    stop_token_ids = list(request.stop_token_ids or [])
    try:
        return SamplingParams(
            n=request.num_choices, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if request.repetition_penalty is None
                                else request.repetition_penalty),
            logit_bias=parse_logit_bias(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids,
            seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens or 0,
            stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=bool(request.ignore_eos),
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
            skip_special_tokens=(skip_special if request.skip_special_tokens is None
                                 else request.skip_special_tokens),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)
    except InvalidParamError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """{"123": 5} -> {123: 5.0}; keys must be token ids (below 10^12 here, in the vocabulary
    by `validate_request`), values -100..100."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"Invalid 'logit_bias': too many entries. Expected at most "
                          f"{MAX_LOGIT_BIAS} token ids, but got {len(bias)} instead.",
                          "logit_bias", "invalid_value")
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.match(key):
            raise bad_request(f"Invalid key in 'logit_bias': {echo(key)}. You should only be "
                              "submitting non-negative integers.", "logit_bias")
        if len(key) > 12:  # never a token id (and int() of 5,000 digits raises)
            raise bad_request(f"Invalid key in 'logit_bias': {echo(key)}. Token ids must be "
                              "below the vocabulary size.", "logit_bias")
        token_id = int(key)
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"Invalid value for 'logit_bias' key {echo(key)}: {echo(value)}. "
                              "Bias values must be between -100 and 100.", "logit_bias")
        parsed[token_id] = float(value)
    return parsed
