"""Prompts -> token ids: the chat template for messages, the four completion prompt forms,
and the engine's request check (`check_prompt`, `check_params`: `plait.engine`'s
validate_prompt / validate_params, each run once). Errors are 400 envelopes naming the
offending field.

Work is linear in the request's size and refused before it starts when the request can
never be served: a text longer than any prompt that fits the context (`check_text_size`:
every token covers at most `max_token_chars` characters) or more prompts than the server
ever admits. Tokenizing, templating and decoding large inputs run off the event loop
(offload.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from plait.engine import (
    EngineClient,
    InvalidParamError,
    SamplingParams,
    decode_ids,
    validate_params,
    validate_prompt,
)
from plait.server.errors import APIError, bad_request, echo
from plait.server.offload import offload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("plait.server")
Truncate = Callable[[list[int]], list[int]]  # a prompt's ids -> the ids the engine gets
_PROMPT_FORMS = "a string, an array of strings, an array of tokens, or an array of token arrays"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: its token ids and, for echo, its text (decoded when given as tokens)."""

    token_ids: list[int]
    text: str


def text_part(part: dict[str, Any], i: int, j: int) -> str:
    """The text of part j of message i's content; a 400 naming it unless it is exactly
    {"type": "text", "text": <string>}."""
    param = f"messages.[{i}].content.[{j}]"
    kind = part.get("type")
    if kind != "text":
        raise bad_request(f"Invalid content part type {echo(kind)} in '{param}': Plait serves "
                          'text-only models; only {"type": "text", "text": ...} parts are '
                          "supported.", f"{param}.type", "invalid_value")
    text = part.get("text")
    if not isinstance(text, str) or set(part) - {"type", "text"}:
        raise bad_request(f"Invalid text part in '{param}': expected {{\"type\": \"text\", "
                          '"text": <string>}.', param, "invalid_value")
    return text


@dataclass(frozen=True, slots=True)
class TemplateFlags:
    """How the rendered chat ends: with the assistant's generation prompt (the default), or
    inside the final (assistant) message, which the model continues (vLLM's
    `continue_final_message`), or after the last message as is."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


def template_flags(messages: list[Any], add_generation_prompt: bool | None,
                   continue_final_message: bool | None) -> TemplateFlags:
    """The request's flags, checked: `continue_final_message` needs an assistant message
    last and excludes `add_generation_prompt` (which it turns off when unset)."""
    if not continue_final_message:
        return TemplateFlags(add_generation_prompt is not False, False)
    if add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both "
                          "be true: the prompt either continues the final message or starts "
                          "a new one.", "continue_final_message", "invalid_value")
    role = messages[-1].role if messages else None
    if role != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be the "
                          f"assistant's message to continue, but its role is {echo(role)}.",
                          "continue_final_message", "invalid_value")
    return TemplateFlags(False, True)


@dataclass(frozen=True, slots=True)
class TemplateInput:
    """What the chat template gets besides the messages: `source` replaces the tokenizer's
    template (None: the tokenizer's own), `tools` go to templates that render them,
    `kwargs` are the request's `chat_template_kwargs` (checked: `template_kwargs`)."""

    flags: TemplateFlags = TemplateFlags()
    tools: list[dict[str, Any]] | None = None
    source: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


# Arguments of transformers' apply_chat_template that the server sets itself.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs"})


def template_kwargs(value: dict[str, Any] | None, param: str = "chat_template_kwargs"
                    ) -> dict[str, Any]:
    """A request's `chat_template_kwargs` (variables for the template, e.g.
    {"enable_thinking": false}); a 400 naming `param` for a key the server sets itself."""
    if not value:
        return {}
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise bad_request(f"Invalid key in '{param}': {echo(key)} is not a template "
                              "variable a request can set.", param, "invalid_value")
    return dict(value)


def no_template_error() -> APIError:
    return bad_request("This model has no chat template, so it cannot serve chat messages. "
                       "Start the server with --chat-template, or send a prompt to "
                       "/v1/completions.", "messages", "invalid_value")


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   template: TemplateInput = TemplateInput()) -> list[int]:
    """Apply the chat template (`template.source`, else the tokenizer's; with `tools` for
    templates that render them), then tokenize without adding special tokens again. A
    400 when there is no template at all."""
    if template.source is None and not getattr(tokenizer, "chat_template", None):
        raise no_template_error()
    flags = template.flags
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=flags.add_generation_prompt,
            continue_final_message=flags.continue_final_message, tokenize=False,
            tools=template.tools, chat_template=template.source, **template.kwargs)
    except TemplateError as exc:  # e.g. raise_exception("Roles must alternate ...")
        raise bad_request(f"The messages do not fit the model's chat template: {exc}",
                          "messages", "invalid_value") from None
    except Exception:  # anything else: its text may hold internals, keep it in the log
        logger.exception("applying the chat template failed")
        raise bad_request("The messages do not fit the model's chat template.",
                          "messages", "invalid_value") from None
    return tokenizer.encode(text, add_special_tokens=False)


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text: a lower bound of the rendered template's."""
    return sum(len(m["content"]) + len(m.get("name", "")) for m in messages)


async def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                          template: TemplateInput = TemplateInput()) -> list[int]:
    """`chat_token_ids`, off the event loop when the messages are large."""
    return await offload(chat_token_ids, tokenizer, messages, template,
                         size=message_chars(messages))


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token's text can hold (its longest vocabulary entry; a
    byte-level entry has one character per byte)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


def check_text_size(engine: EngineClient, tokenizer: PreTrainedTokenizerBase, num_chars: int,
                    param: str) -> None:
    """400 `context_length_exceeded`, before any tokenizing, for text that no tokenization
    can fit into the context: n tokens hold at most n * max_token_chars characters (x2 of
    headroom for normalizers that merge characters)."""
    max_model_len = engine.info.max_model_len
    if num_chars > 2 * max_model_len * max_token_chars(tokenizer):
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. "
                          f"However, the text of '{param}' has {num_chars} characters, more "
                          "than that context can hold.", param, "context_length_exceeded")


def num_prompts(prompt: str | list[Any]) -> int:
    """How many prompts `prompt` holds (a constant-time look at its form; validated later)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


async def completion_prompts(engine: EngineClient, prompt: str | list[Any],
                             truncate: Truncate | None = None) -> list[Prompt]:
    """The prompt forms of /v1/completions, each as token ids (+ text for echo), checked
    against the context before the expensive work; large inputs off the event loop.
    `truncate` (vLLM's truncate_prompt_tokens) cuts each prompt's ids before the checks;
    a cut prompt's text is its ids decoded."""
    if isinstance(prompt, str) or num_prompts(prompt) == 1:
        size = len(prompt)  # characters, or tokens of one token array
    else:  # at most the admission window's number of prompts (checked before)
        size = sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    return await offload(_completion_prompts, engine, prompt, truncate, size=size)


def _completion_prompts(engine: EngineClient, prompt: str | list[Any],
                        truncate: Truncate | None) -> list[Prompt]:
    tokenizer = engine.tokenizer
    if isinstance(prompt, str):
        return [_text_prompt(engine, prompt, truncate)]
    if not prompt:
        raise bad_request(f"Invalid 'prompt': empty array. Expected {_PROMPT_FORMS}.",
                          "prompt", "empty_array")
    if all(isinstance(p, str) for p in prompt):
        for text in prompt:  # every size check before any tokenizing
            check_text_size(engine, tokenizer, len(text), "prompt")
        return [_text_prompt(engine, p, truncate) for p in prompt]
    if all(_is_token(t) for t in prompt):
        return [_token_prompt(engine, _cut(prompt, truncate))]
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        cut = [_cut(p, truncate) for p in prompt]
        for token_ids in cut:  # every check before any decoding
            check_prompt(engine, token_ids, "prompt")
        return [_token_prompt(engine, p, checked=True) for p in cut]
    raise bad_request(f"Invalid type for 'prompt': expected {_PROMPT_FORMS}.", "prompt",
                      "invalid_type")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cut(token_ids: list[int], truncate: Truncate | None) -> list[int]:
    return token_ids if truncate is None else truncate(token_ids)


def _text_prompt(engine: EngineClient, text: str, truncate: Truncate | None = None) -> Prompt:
    check_text_size(engine, engine.tokenizer, len(text), "prompt")
    token_ids = engine.tokenizer.encode(text)
    cut = _cut(token_ids, truncate)
    check_prompt(engine, cut, "prompt")
    if len(cut) != len(token_ids):
        text = decode_ids(engine.tokenizer, cut)
    return Prompt(cut, text)


def _token_prompt(engine: EngineClient, token_ids: list[int], checked: bool = False) -> Prompt:
    """Checked first (length before content), so a long or bad token list is never
    decoded."""
    if not checked:
        check_prompt(engine, token_ids, "prompt")
    return Prompt(list(token_ids), decode_ids(engine.tokenizer, token_ids))


def check_prompt(engine: EngineClient, token_ids: list[int], param: str) -> None:
    """The engine's prompt check (`validate_prompt`: not empty, fits the context and the
    KV pool, every id in the vocabulary) as a 400 naming `param`."""
    try:
        validate_prompt(engine.info, token_ids, param)
    except InvalidParamError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None


def check_params(engine: EngineClient, params: SamplingParams) -> None:
    """The engine's parameter check (`validate_params`: token ids and `top_k` against the
    vocabulary) as a 400 naming the parameter."""
    try:
        validate_params(engine.info, params)
    except InvalidParamError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None
