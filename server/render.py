"""POST /v1/chat/completions/render and /v1/completions/render: the prompt's token ids exactly
as the engine would get them for the same body, without generating.

An inference router's tokenizer (the endpoint picker's `token-producer` in llm-d-router)
calls these so that the block keys it computes are the ones the server caches. The body is
the generation request's, validated by the same code (`chat_input`, `completion_input`), so
a request the real endpoint refuses gets the same 400 envelope here; `stream` is accepted
and the answer is JSON all the same. The shapes are vLLM's (its `GenerateRequest`, of which
routers read `token_ids` and `features`):

    chat:         {"request_id": "chatcmpl-...", "model": ..., "token_ids": [...],
                   "features": null}
    completions:  [{"request_id": "cmpl-...", "model": ..., "token_ids": [...],
                    "features": null}, ...]                          one object per prompt

`features` (vLLM's multimodal hashes and placeholders) is always null: Plait serves
text-only models.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from plait.server.chat import chat_input
from plait.server.completions import completion_input
from plait.server.generation import new_completion_id
from plait.server.offload import json_response
from plait.server.protocol import ChatCompletionRequest, CompletionRequest
from plait.server.routing import ApiRoute
from plait.server.state import ReadyDep

router = APIRouter(route_class=ApiRoute)


@router.post("/v1/chat/completions/render", response_model=dict[str, Any])
async def render_chat_completion(body: ChatCompletionRequest, state: ReadyDep) -> Response:
    """The chat request's prompt token ids (template, tools, `add_generation_prompt`,
    `continue_final_message` applied as /v1/chat/completions applies them)."""
    checked = await chat_input(body, state)
    return await json_response(_rendered("chatcmpl", state.model_name, checked.token_ids),
                               size=len(checked.token_ids))


@router.post("/v1/completions/render", response_model=list[dict[str, Any]])
async def render_completion(body: CompletionRequest, state: ReadyDep) -> Response:
    """One object per prompt of the completion request, in order."""
    _, prompts = await completion_input(body, state)
    rendered = [_rendered("cmpl", state.model_name, p.token_ids) for p in prompts]
    return await json_response(rendered, size=sum(len(p.token_ids) for p in prompts))


def _rendered(prefix: str, model: str, token_ids: list[int]) -> dict[str, Any]:
    return {"request_id": new_completion_id(prefix), "model": model,
            "token_ids": list(token_ids), "features": None}
