"""The `POST /v1/responses` body (pydantic v2), validated strictly like chat's.

Unknown fields are a 400 "Unrecognized request argument supplied: X". Fields OpenAI defines
but Plait cannot honour are declared as `Any` and refused by `reject_unsupported` unless
they are null or mean "off" (`background: false`, `truncation: "disabled"`). Input items,
tools, `tool_choice` and `text` are plain JSON here and checked in translate.py, which names
the exact field in its errors.

Beyond OpenAI's fields, Plait accepts `n` (several `message` items from one prompt) and the
sampling parameters its chat route has (`top_k`, `min_p`, `stop`, penalties, ...), as vLLM
accepts its own extra fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plait.server.errors import bad_request, echo
from plait.server.protocol import INT32_MAX, INT64_MAX, INT64_MIN, StopString, StrictModel

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponseStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted; Plait never obfuscates


class ResponsesRequest(StrictModel):
    """One `POST /v1/responses` body. Defaults are OpenAI's (applied where used)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Plait's extension: n message items sampled from one prompt (computed once).
    n: int | None = Field(None, ge=1, le=128)
    # Chat's sampling extras (vLLM names), passed through as they are.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    # OpenAI parameters Plait does not implement (see UNSUPPORTED).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def stored(self) -> bool:
        return self.store is not False


# Passed to the chat request unchanged (same names, same meaning).
PASSTHROUGH = ("temperature", "top_p", "seed", "n", "user", "prompt_cache_key",
               "safety_identifier", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "min_tokens",
               "ignore_eos", "parallel_tool_calls")

# name -> the non-null values that mean "feature off" and are therefore accepted.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "prompt": (),
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),
    "truncation": ("disabled",), "max_tool_calls": (), "service_tier": ("auto", "default"),
    "context_management": (), "prompt_cache_retention": (),
}


def reject_unsupported(body: ResponsesRequest) -> None:
    """Raise a 400 naming the first parameter Plait cannot honour (never ignore it)."""
    for name, allowed in UNSUPPORTED.items():
        value = getattr(body, name)
        if value is None or any(value == ok for ok in allowed):
            continue
        raise bad_request(f"Plait does not support the '{name}' parameter.", name,
                          "unsupported_parameter")
    for i, item in enumerate(body.include or []):
        if item != LOGPROBS_INCLUDE:
            raise bad_request(f"Plait does not support including {echo(item)}: the only "
                              f"supported value is {echo(LOGPROBS_INCLUDE)}.",
                              f"include.[{i}]", "unsupported_parameter")
