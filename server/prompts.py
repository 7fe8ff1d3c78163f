"""Prompts -> token ids: the chat template for messages, the four completion prompt forms,
and the engine's request check. Errors are 400 envelopes naming the offending field."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from plait.engine import EngineClient, InvalidParamError, SamplingParams, validate_request
from plait.server.errors import bad_request
from plait.server.protocol import ChatMessage

logger = logging.getLogger("plait.server")
_PROMPT_FORMS = "a string, an array of strings, an array of tokens, or an array of token arrays"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: its token ids and, for echo, its text (decoded when given as tokens)."""

    token_ids: list[int]
    text: str


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Template-ready messages; text parts are joined with newlines (as vLLM does)."""
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            raise bad_request(f"Invalid value for 'messages.[{i}].content': expected a string "
                              "or an array of text parts, but got null instead.",
                              f"messages.[{i}].content", "invalid_value")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        result.append(entry)
    return result


def _text_part(part: dict[str, Any], i: int, j: int) -> str:
    param = f"messages.[{i}].content.[{j}]"
    kind = part.get("type")
    if kind != "text":
        raise bad_request(f"Invalid content part type {kind!r} in '{param}': Plait serves "
                          "text-only models; only {'type': 'text', 'text': ...} parts are "
                          "supported.", f"{param}.type", "invalid_value")
    text = part.get("text")
    if not isinstance(text, str) or set(part) - {"type", "text"}:
        raise bad_request(f"Invalid text part in '{param}': expected {{'type': 'text', "
                          "'text': <string>}.", param, "invalid_value")
    return text


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]],
                   add_generation_prompt: bool = True) -> list[int]:
    """Apply the model's chat template, then tokenize without adding special tokens again."""
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except TemplateError as exc:  # e.g. raise_exception("Roles must alternate ...")
        raise bad_request(f"The messages do not fit the model's chat template: {exc}",
                          "messages", "invalid_value") from None
    except Exception:  # anything else: its text may hold internals, keep it in the log
        logger.exception("applying the chat template failed")
        raise bad_request("The messages do not fit the model's chat template.",
                          "messages", "invalid_value") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompts(tokenizer: Any, prompt: str | list[Any], vocab_size: int) -> list[Prompt]:
    """The prompt forms of /v1/completions, each as token ids (+ text for echo)."""
    if isinstance(prompt, str):
        return [_text_prompt(tokenizer, prompt)]
    if not prompt:
        raise bad_request(f"Invalid 'prompt': empty array. Expected {_PROMPT_FORMS}.",
                          "prompt", "empty_array")
    if all(isinstance(p, str) for p in prompt):
        return [_text_prompt(tokenizer, p) for p in prompt]
    if all(_is_token(t) for t in prompt):
        return [_token_prompt(tokenizer, prompt, vocab_size)]
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return [_token_prompt(tokenizer, p, vocab_size) for p in prompt]
    raise bad_request(f"Invalid type for 'prompt': expected {_PROMPT_FORMS}.", "prompt",
                      "invalid_type")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_prompt(tokenizer: Any, text: str) -> Prompt:
    return Prompt(tokenizer.encode(text), text)


def _token_prompt(tokenizer: Any, token_ids: list[int], vocab_size: int) -> Prompt:
    """Token ids as given; `validate_prompts` checks them against the vocabulary. Ids
    outside it are left out of the echo text (decoding them would fail)."""
    return Prompt(list(token_ids), tokenizer.decode([t for t in token_ids
                                                     if 0 <= t < vocab_size]))


def validate_prompts(engine: EngineClient, prompts: list[Prompt], params: SamplingParams,
                     param: str) -> None:
    """The engine's one request check (`plait.engine.validate_request`: prompt fit and
    vocabulary), once per prompt before fan-out; its rejection as a 400 naming the field."""
    for prompt in prompts:
        try:
            validate_request(engine.info, prompt.token_ids, params, param)
        except InvalidParamError as exc:
            raise bad_request(str(exc), exc.param, exc.code) from None
