"""Per-app state (`app.state.plait`) and the Annotated dependencies routes take.

Tests may override `get_state` (or build the app around their own engine) through
`app.dependency_overrides`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from plait.engine import EngineClient, TokenTextTable
from plait.server.errors import ENGINE_STOPPED_MESSAGE, APIError, clip, service_unavailable
from plait.server.metrics import ServerMetrics
from plait.server.settings import ServerSettings


@dataclass(eq=False)
class ServerState:
    """What the routes share. `token_text` and `model_name` exist once the engine loaded.

    `load_error` is set (one line, no traceback) when loading failed; `draining` once the
    server received its shutdown signal. Either turns /health to 503.
    """

    settings: ServerSettings
    engine: EngineClient
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenTextTable | None = None
    load_error: str | None = None
    draining: bool = False

    @property
    def model_name(self) -> str:
        """The name requests must use (the served name, else the engine's model name)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return self.engine.info.model_name

    @property
    def chat_template(self) -> str | None:
        """The template chats are rendered with: --chat-template's, else the tokenizer's
        own (None when it has none, or a set of named templates transformers picks from)."""
        if self.settings.chat_template is not None:
            return self.settings.chat_template
        template = getattr(self.engine.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def serving(self) -> bool:
        return self.engine.healthy and not self.draining and self.token_text is not None


def get_state(request: Request) -> ServerState:
    return request.app.state.plait


StateDep = Annotated[ServerState, Depends(get_state)]


def get_ready_state(state: StateDep) -> ServerState:
    """The state, once the engine can take requests; else a 503 envelope."""
    if state.serving:
        return state
    if state.load_error is not None:
        message = "The model failed to load; see the server log."
    elif not state.engine.ready or state.token_text is None:
        message = "The model is still loading; retry shortly."
    elif state.draining:
        message = "The server is shutting down."
    else:
        message = ENGINE_STOPPED_MESSAGE
    raise service_unavailable(message)


def require_ready(state: StateDep) -> ServerState:
    """`get_ready_state` for the API routes: a refusal is counted in /metrics."""
    try:
        return get_ready_state(state)
    except APIError:
        state.metrics.requests_refused.labels("unavailable").inc()
        raise


ReadyDep = Annotated[ServerState, Depends(require_ready)]


def check_model(state: ServerState, model: str | None, required: bool = True) -> None:
    """404 `model_not_found` unless `model` is the served name (None passes if optional)."""
    if model is None and not required:
        return
    if model != state.model_name:
        raise APIError(404, f"The model `{clip(str(model))}` does not exist or you do not have "
                       "access to it.", code="model_not_found")


def request_id_of(request: Request) -> str | None:
    """The id `RequestIdMiddleware` put in the scope (for logs)."""
    return request.scope.get("state", {}).get("request_id")
