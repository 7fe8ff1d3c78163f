"""The one check of a request against the running engine: prompt fit and vocabulary.

Every path into the engine runs it once, before adding a request, never again inside the
engine loop, so an engine-side rejection can not surface late as a failed stream:
`validate_request` (the offline `LLM`), or its two halves where the HTTP layer has them at
different times (`validate_prompt` as each prompt is tokenized, before a long one is ever
decoded; `validate_params` once per request). Errors carry the parameter to name in a 400
(`InvalidParamError.param`) and its OpenAI code (`.code`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from plait.engine.config import RuntimeInfo
from plait.engine.sampling_params import InvalidParamError, SamplingParams


class RequestRejected(InvalidParamError):
    """The prompt can never be served: empty, too long for the model or the KV pool
    (`code` "context_length_exceeded"), or holding a token outside the vocabulary."""

    def __init__(self, message: str, param: str = "prompt",
                 code: str = "context_length_exceeded") -> None:
        super().__init__(param, message, code)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def check_prompt_fits(num_prompt: int, max_model_len: int, num_blocks: int,
                      block_size: int, param: str = "prompt") -> None:
    """Raise `RequestRejected` unless the prompt plus one generated token can ever fit."""
    if num_prompt == 0:
        raise RequestRejected(f"Invalid '{param}': the prompt is empty.", param, "invalid_value")
    if num_prompt + 1 > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt has {num_prompt} tokens; with one generated token that exceeds the "
            f"maximum context length of {max_model_len} tokens.", param)
    if cdiv(num_prompt + 1, block_size) > num_blocks:
        raise RequestRejected(f"the prompt has {num_prompt} tokens, more than the KV cache "
                              f"can hold ({num_blocks * block_size})", param)


def _outside(token_ids: Iterable[int], vocab_size: int) -> int | None:
    return next((t for t in token_ids if not 0 <= t < vocab_size), None)


def _show(token_id: int) -> str:
    """A client's integer for a message (a 5,000-digit one cannot even be printed)."""
    return str(token_id) if abs(token_id) < 10**18 else "(an integer of over 18 digits)"


def validate_prompt(info: RuntimeInfo, prompt_token_ids: Sequence[int],
                    param: str = "prompt") -> None:
    """Raise `RequestRejected` unless the prompt is not empty, fits the context and the KV
    pool, and holds only token ids of the vocabulary (its length is checked first, so a
    prompt too long is refused without reading it). `param` names it in errors."""
    check_prompt_fits(len(prompt_token_ids), info.max_model_len, info.num_kv_blocks,
                      info.block_size, param)
    vocab = info.vocab_size
    bad = _outside(prompt_token_ids, vocab)
    if bad is not None:
        raise RequestRejected(f"Invalid '{param}': token id {_show(bad)} is outside the "
                              f"vocabulary [0, {vocab}).", param, "invalid_value")


def validate_params(info: RuntimeInfo, params: SamplingParams) -> None:
    """Raise `InvalidParamError` unless every token id of `logit_bias` and `stop_token_ids`
    is in the vocabulary and `top_k` is at most its size."""
    vocab = info.vocab_size
    if params.top_k is not None and params.top_k > vocab:
        raise InvalidParamError(
            "top_k", f"Invalid 'top_k': integer above maximum value. Expected a value <= "
            f"{vocab} (the vocabulary size), or -1 or 0 to disable it, but got "
            f"{_show(params.top_k)} instead.", "integer_above_max_value")
    # logit_bias keys are reported without a code, as OpenAI reports its own key errors.
    for name, ids, code in (("logit_bias", params.logit_bias or {}, None),
                            ("stop_token_ids", params.stop_token_ids, "invalid_value"),
                            ("allowed_token_ids", params.allowed_token_ids or [],
                             "invalid_value")):
        bad = _outside(ids, vocab)
        if bad is not None:
            raise InvalidParamError(name, f"Invalid '{name}': token id {_show(bad)} is "
                                    f"outside the vocabulary [0, {vocab}).", code)


def validate_request(info: RuntimeInfo, prompt_token_ids: Sequence[int],
                     params: SamplingParams, prompt_param: str = "prompt") -> None:
    """`validate_prompt` and `validate_params`: raise `RequestRejected` /
    `InvalidParamError` (with the parameter to name) unless the engine can serve it."""
    validate_prompt(info, prompt_token_ids, prompt_param)
    validate_params(info, params)
