"""Request bodies of the OpenAI endpoints (pydantic v2), validated strictly.

Models forbid unknown fields (-> 400 "Unrecognized request argument supplied: X", as OpenAI)
and validate in strict mode (no "5" -> 5 coercion). Parameters that OpenAI defines but Plait
does not implement are declared as `Any` so that they are recognised, then rejected by
`reject_unsupported` unless they are null (or a value that means "off").
Every optional field accepts an explicit `null`; defaults are applied in `params.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from plait.server.errors import bad_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # the bound of every count a client sends (tokens, top_k)
MAX_STOP_STRINGS = 4  # OpenAI's limit; see README of the server package
MAX_STOP_CHARS = 4096  # per stop string: the detokenizer holds back up to this much text
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary Plait serves


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; Plait never obfuscates
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk (extras.py)


class ChatMessage(StrictModel):
    """One message. `content` is a string or a list of `{"type": "text", "text": ...}` parts
    (checked in prompts.py, which gives precise errors for other part types)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Checked in constrained/request_fields.py, output_plan.py (exact shapes, precise errors).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An assistant message's reasoning, as a reasoning parser returned it (either name);
    # given to the template as `reasoning_content` (output_plan.render_messages).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # Assistant-message fields of features Plait lacks; the SDK round-trips them as null.
    refusal: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None


class SamplingRequest(StrictModel):
    """Fields shared by chat and legacy completions (OpenAI's, then vLLM-style extras)."""

    model: str
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: (StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
           | None) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (vLLM names)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # and <= vocab size (params.py)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)  # extras.py
    return_token_ids: bool | None = None
    # vLLM extras (extras.py): prompt truncation, a token whitelist, vLLM's grammar field.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: Annotated[list[int], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """A final usage chunk: `include_usage`, or, as vLLM (whose default it is), when
        unset and `continuous_usage_stats` is on."""
        options = self.stream_options
        if options is None:
            return False
        if options.include_usage is None:
            return bool(options.continuous_usage_stats)
        return options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's `continuous_usage_stats`, with usage included)."""
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM extras: how the chat template ends the prompt (see prompts.template_flags).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template
    # Identifiers that do not change the output.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Structured output and tools: JSON here, validated in constrained/request_fields.py.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI parameters Plait does not implement (see UNSUPPORTED).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None


class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked in prompts.py for clear errors.
    prompt: str | list[Any]
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    response_format: dict[str, Any] | None = None  # as chat's (vLLM accepts it here too)
    suffix: Any = None


class TokenizeRequest(StrictModel):
    """`prompt` (completion style) or `messages` (chat style), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as chat's
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ unsupported parameters
# name -> the non-null values that mean "feature off" and are therefore accepted.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (), "function_call": ("none",), "audio": (),
    "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "verbosity": (),
    "web_search_options": (), "store": (False,), "metadata": (), "service_tier": (),
    "suffix": ("",),
}
MESSAGE_UNSUPPORTED = ("refusal", "function_call", "audio", "annotations")


def reject_unsupported(request: BaseModel) -> None:
    """Raise a 400 naming the first parameter Plait cannot honour (never ignore it)."""
    for name, allowed in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if value is None or any(value == ok for ok in allowed):
            continue
        raise bad_request(f"Plait does not support the '{name}' parameter.", name,
                          "unsupported_parameter")
    for i, message in enumerate(getattr(request, "messages", None) or []):
        for name in MESSAGE_UNSUPPORTED:
            if getattr(message, name) is not None:
                raise bad_request(f"Plait does not support '{name}' in messages.",
                                  f"messages.[{i}].{name}", "unsupported_parameter")
