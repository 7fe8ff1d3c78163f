"""Request bodies for the OpenAI routes, as the server and reliability tests send them.

    chat_body(messages, *defaults, **fields)        /v1/chat/completions
    completion_body(prompt, *defaults, **fields)    /v1/completions
    GREEDY                                          temperature 0 and ignore_eos: the same
                                                    tokens every time, never cut by EOS

`messages` may be a string: one user message. The model is MODEL (the default model's
served name) unless `model=` says otherwise. `defaults` are dicts of fields (a module's
usual settings) merged in order, then `fields`, so a call can override a module default.
"""

from __future__ import annotations

from typing import Any

from helpers.server import MODEL

GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}


def _merge(defaults: tuple[dict[str, Any], ...], fields: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {"model": MODEL}
    for d in defaults:
        merged.update(d)
    merged.update(fields)
    return merged


def chat_body(messages: str | list[dict[str, Any]], *defaults: dict[str, Any],
              **fields: Any) -> dict[str, Any]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = _merge(defaults, fields)
    return {"model": body.pop("model"), "messages": messages, **body}


def completion_body(prompt: Any, *defaults: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body = _merge(defaults, fields)
    return {"model": body.pop("model"), "prompt": prompt, **body}
