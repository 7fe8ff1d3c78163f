"""Operational and utility routes.

Open (no API key): GET /health, GET /metrics, GET /version.
Guarded: GET /v1/models, GET /v1/models/{model}, POST /tokenize, POST /detokenize.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import plait
from plait.server.errors import APIError, bad_request
from plait.server.prompts import chat_token_ids, message_dicts
from plait.server.protocol import DetokenizeRequest, TokenizeRequest, reject_unsupported
from plait.server.state import ReadyDep, StateDep, check_model, get_ready_state

open_router = APIRouter()
router = APIRouter()


@open_router.get("/health")
async def health(state: StateDep) -> Response:
    """200 once the engine serves; 503 while loading, draining, or after the engine died."""
    try:
        get_ready_state(state)
    except APIError as exc:
        return JSONResponse(exc.body(), status_code=503)
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


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ReadyDep) -> dict[str, Any]:
    """`prompt` is tokenized as /v1/completions does (special tokens added by default);
    `messages` through the chat template (generation prompt added by default)."""
    check_model(state, body.model, required=False)
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Provide exactly one of 'prompt' and 'messages'.", "prompt")
    if body.messages is not None:
        reject_unsupported(body)
        add_generation = body.add_generation_prompt is not False
        tokens = chat_token_ids(tokenizer, message_dicts(body.messages), add_generation)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                  is not False)
    return {"tokens": tokens, "count": len(tokens),
            "max_model_len": state.engine.info.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ReadyDep) -> dict[str, Any]:
    check_model(state, body.model, required=False)
    vocab_size = state.engine.info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Invalid 'tokens': token id {bad} is outside the vocabulary "
                          f"[0, {vocab_size}).", "tokens", "invalid_value")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}
