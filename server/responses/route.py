"""The /v1/responses routes.

    POST   /v1/responses                    create (translate.py -> chat_input -> Generation)
    GET    /v1/responses/{id}               a stored response
    GET    /v1/responses/{id}/input_items   its input items, paged (order, limit, after)
    DELETE /v1/responses/{id}               {"id", "object": "response.deleted", "deleted"}

An unknown, deleted or expired id is a 404 in the OpenAI envelope (store.py keeps responses
for --responses-ttl seconds, at most --responses-store-size of them, per process).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from plait.server.chat import chat_input
from plait.server.errors import APIError, bad_request, clip
from plait.server.generation import Generation
from plait.server.prompts import Prompt
from plait.server.responses.objects import ResponseContext
from plait.server.responses.protocol import ResponsesRequest, reject_unsupported
from plait.server.responses.store import ResponseStore, StoredResponse
from plait.server.responses.stream import response_events
from plait.server.responses.translate import chat_request, input_items, renamed
from plait.server.routing import ApiRoute
from plait.server.serving import serve_generation
from plait.server.state import ReadyDep, check_model, request_id_of

router = APIRouter(route_class=ApiRoute)


def get_store(request: Request) -> ResponseStore:
    return request.app.state.responses


StoreDep = Annotated[ResponseStore, Depends(get_store)]


def _stored(store: ResponseStore, response_id: str, param: str | None = None,
            what: str = "Response") -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"{what} with id '{clip(response_id)}' not found.", param=param,
                       code="not_found")
    return entry


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: ReadyDep,
                          store: StoreDep) -> Response:
    check_model(state, body.model)
    reject_unsupported(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = _stored(store, body.previous_response_id, "previous_response_id",
                          "Previous response").context
    items = input_items(body.input)
    chat_body = chat_request(body, [*history, *items])
    checked = await renamed(chat_input(chat_body, state))
    response_id = f"resp_{uuid.uuid4().hex}"
    num_top = chat_body.top_logprobs if chat_body.logprobs else None
    ctx = ResponseContext(body, response_id, state.model_name, checked.output, num_top, items,
                          history, store)
    gen = Generation(state, response_id, [Prompt(checked.token_ids, "")], checked.plan,
                     keep_output=not body.streaming, log_id=request_id_of(request))
    return await serve_generation(
        request, gen, build=ctx.complete,
        stream=(lambda g: response_events(g, ctx)) if body.streaming else None)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, store: StoreDep) -> Response:
    return JSONResponse(_stored(store, response_id).response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, store: StoreDep,
                           order: Literal["asc", "desc"] = "desc",
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           after: str | None = None) -> Response:
    items = _stored(store, response_id).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"Invalid 'after': no input item with id '{clip(after)}' in "
                              "this response.", "after", "invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: StoreDep) -> Response:
    if not store.delete(response_id):
        _stored(store, response_id)  # the 404
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
