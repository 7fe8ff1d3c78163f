"""Operational and utility routes.

Open (no API key): GET /health (readiness), GET /live (liveness), GET /metrics, GET /version.
Guarded: GET /v1/models, GET /v1/models/{model}, POST /tokenize, POST /detokenize,
GET /tokenizer_info.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import plait
from plait.engine import EngineClient, decode_ids
from plait.server.constrained.output_plan import (
    chat_output_plan,
    conversation_plan,
    render_messages,
)
from plait.server.errors import APIError, bad_request, echo
from plait.server.offload import json_response, offload
from plait.server.prompts import TemplateInput, chat_prompt_ids, template_flags, template_kwargs
from plait.server.protocol import DetokenizeRequest, TokenizeRequest, reject_unsupported
from plait.server.routing import ApiRoute
from plait.server.state import ReadyDep, StateDep, check_model, get_ready_state

open_router = APIRouter()
router = APIRouter(route_class=ApiRoute)


@open_router.get("/health")
async def health(state: StateDep) -> Response:
    """200 once the engine serves; 503 while loading, draining, or after the engine died."""
    try:
        get_ready_state(state)
    except APIError as exc:
        return JSONResponse(exc.body(), status_code=503)
    return JSONResponse({"status": "ok"})


@open_router.get("/live")
async def live(state: StateDep) -> Response:
    """Liveness: 200 while this process answers and its engine has not died (loading and
    draining included, so a kubelet never restarts a server for either); 503 once the
    engine is gone for good, the one state a restart mends."""
    if state.engine.dead_error is not None:
        return JSONResponse({"status": "engine dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@open_router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@open_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": plait.__version__}


def _model_card(state: Any) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "plait", "root": state.engine.info.model_name,
            "max_model_len": state.engine.info.max_model_len}


@router.get("/v1/models")
async def list_models(state: ReadyDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: ReadyDep) -> dict[str, Any]:
    check_model(state, model)
    return _model_card(state)


@router.post("/tokenize", response_model=dict[str, Any])
async def tokenize(body: TokenizeRequest, state: ReadyDep) -> Response:
    """`prompt` is tokenized as /v1/completions does (special tokens added by default);
    `messages` through the chat template as /v1/chat/completions does (generation prompt
    added unless `add_generation_prompt` is false or `continue_final_message` is true).
    vLLM's answer: {count, max_model_len, tokens, token_strs}, the last one the vocabulary
    strings of the tokens with `return_token_strs`, else null."""
    check_model(state, body.model, required=False)
    tokenizer = state.engine.tokenizer
    if body.messages is not None and body.prompt is None:
        reject_unsupported(body)
        flags = template_flags(body.messages, body.add_generation_prompt,
                               body.continue_final_message)
        template = state.chat_template
        # With tools, the prompt chat completions builds for them (tool_choice "auto").
        parser_name = state.settings.tool_call_parser
        output = (conversation_plan(template, parser_name) if body.tools is None else
                  await chat_output_plan(_ToolsOnly(body.tools), template, parser_name))
        messages = render_messages(body.messages, output)
        tokens = await chat_prompt_ids(tokenizer, messages, TemplateInput(
            flags, output.template_tools, template, template_kwargs(body.chat_template_kwargs)))
    elif body.prompt is not None and body.messages is None:
        for name in ("add_generation_prompt", "continue_final_message", "tools",
                     "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise bad_request(f"'{name}' applies to 'messages' only, not to 'prompt'.",
                                  name, "invalid_value")
        encode = functools.partial(tokenizer.encode,
                                   add_special_tokens=body.add_special_tokens is not False)
        tokens = await offload(encode, body.prompt, size=len(body.prompt))
    else:
        raise bad_request("Provide exactly one of 'prompt' and 'messages'.", "prompt")
    result = {"count": len(tokens), "max_model_len": state.engine.info.max_model_len,
              "tokens": tokens, "token_strs": None}
    if body.return_token_strs:
        result["token_strs"] = await offload(tokenizer.convert_ids_to_tokens, tokens,
                                             size=len(tokens))
    return await json_response(result, size=len(tokens))


@dataclass(frozen=True, slots=True)
class _ToolsOnly:
    """The chat-request fields `chat_output_plan` reads, for /tokenize's `tools`."""

    tools: list[dict[str, Any]]
    tool_choice: None = None
    parallel_tool_calls: None = None
    response_format: None = None
    structured_outputs: None = None


@router.get("/tokenizer_info", response_model=dict[str, Any])
async def tokenizer_info(state: ReadyDep) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init kwargs (its tokenizer_config.json as
    loaded) minus file paths, special tokens as their text, `tokenizer_class` the loaded
    class's name, and the chat template chats are rendered with (--chat-template's, else
    the model's; absent when there is none)."""
    tokenizer = state.engine.tokenizer
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "chat_template"):
        config.pop(key, None)
    info: dict[str, Any] = _json_safe(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = state.chat_template
    if template:
        info["chat_template"] = template
    return info


def _json_safe(value: Any) -> Any:
    """AddedToken -> its text; containers recursively; anything else not JSON -> str."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return str(value)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ReadyDep) -> dict[str, Any]:
    check_model(state, body.model, required=False)
    text = await offload(_detokenize, state.engine, body.tokens, size=len(body.tokens))
    return {"prompt": text}


def _detokenize(engine: EngineClient, tokens: list[int]) -> str:
    vocab_size = engine.info.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Invalid 'tokens': token id {echo(bad)} is outside the vocabulary "
                          f"[0, {vocab_size}).", "tokens", "invalid_value")
    return decode_ids(engine.tokenizer, tokens)
