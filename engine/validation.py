"""The one check of a request against the running engine: prompt fit and vocabulary.

`validate_request` runs once per prompt on every path into the engine (the HTTP layer
before fan-out, the offline `LLM` before adding), never again inside the engine loop, so
an engine-side rejection can not surface late as a failed stream. Its errors carry the
parameter to name in a 400 (`InvalidParamError.param`).
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


def validate_request(info: RuntimeInfo, prompt_token_ids: Sequence[int],
                     params: SamplingParams, prompt_param: str = "prompt") -> None:
    """Raise `RequestRejected` / `InvalidParamError` unless the engine can serve it.

    Checks that the prompt is not empty and fits the context and the KV pool, and that
    every token id (prompt, `logit_bias` keys, `stop_token_ids`) is in the vocabulary.
    `prompt_param` names the prompt in errors ("prompt", or "messages" for chat)."""
    check_prompt_fits(len(prompt_token_ids), info.max_model_len, info.num_kv_blocks,
                      info.block_size, prompt_param)
    vocab = info.vocab_size
    bad = _outside(prompt_token_ids, vocab)
    if bad is not None:
        raise RequestRejected(f"Invalid '{prompt_param}': token id {bad} is outside the "
                              f"vocabulary [0, {vocab}).", prompt_param, "invalid_value")
    # logit_bias keys are reported without a code, as OpenAI reports its own key errors.
    for name, ids, code in (("logit_bias", params.logit_bias or {}, None),
                            ("stop_token_ids", params.stop_token_ids, "invalid_value")):
        bad = _outside(ids, vocab)
        if bad is not None:
            raise InvalidParamError(name, f"Invalid '{name}': token id {bad} is outside the "
                                    f"vocabulary [0, {vocab}).", code)
