"""The HTTP side of `plait bench`: one streamed request timed chunk by chunk, the model list,
and /tokenize (which Plait and vLLM serve; other servers may not).

A request is streamed with `stream_options: {"include_usage": true}` so the server reports
exact token counts; a server that sends no usage chunk is measured by its content chunks
(one chunk is taken as one token). Nothing here raises on a server error: the error lands in
`StreamResult.error` and the run goes on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `plait --help` does not load the HTTP client
    import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload. Exactly one of `prompt` (completions) and `messages`
    (chat) is set; `max_tokens` None leaves the server's default; `n` choices share it."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    n: int = 1


@dataclass(frozen=True, slots=True)
class BodyOptions:
    """What every request of a run sends besides its prompt."""

    model: str
    temperature: float = 1.0
    ignore_eos: bool = True  # a vLLM / Plait extra: every choice makes max_tokens tokens
    extra: dict[str, Any] = field(default_factory=dict)  # merged in last (--extra-body)


@dataclass(slots=True)
class StreamResult:
    """One streamed request as the client saw it; times in seconds from its send.

    `token_times[i]` holds the arrival time of each chunk with non-empty text for choice i.
    `completion_tokens` / `prompt_tokens` come from the usage chunk, None without one.
    """

    token_times: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    e2e_s: float | None = None
    status: int | None = None
    error: str | None = None
    done: bool = False  # the stream's final "data: [DONE]" arrived

    @property
    def num_chunks(self) -> int:
        return sum(len(times) for times in self.token_times.values())

    @property
    def output_tokens(self) -> int:
        """Usage's completion tokens, or the content chunks when the server sent no usage."""
        return self.num_chunks if self.completion_tokens is None else self.completion_tokens


def is_chat(path: str) -> bool:
    return path.rstrip("/").endswith("chat/completions")


def request_body(spec: RequestSpec, path: str, options: BodyOptions) -> dict[str, Any]:
    """The JSON body of `spec` for `path`; a prompt sent to a chat path becomes one user
    message. Raises ValueError for messages sent to a completions path."""
    body: dict[str, Any] = {"model": options.model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": options.temperature}
    if is_chat(path):
        body["messages"] = (spec.messages if spec.messages is not None
                            else [{"role": "user", "content": spec.prompt}])
    elif spec.messages is not None:
        raise ValueError(f"a chat request (messages) cannot go to {path}; use --endpoint {CHAT}")
    else:
        body["prompt"] = spec.prompt
    if spec.n != 1:
        body["n"] = spec.n
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
        if options.ignore_eos:
            body["ignore_eos"] = True
    body.update(options.extra)
    return body


def _choice_text(choice: dict[str, Any]) -> str:
    """The text a completions choice or a chat delta carries (reasoning text counts)."""
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def stream_request(client: httpx.AsyncClient, path: str,
                         body: dict[str, Any]) -> StreamResult:
    """POST one streamed request and time each choice's content chunks."""
    import httpx

    out = StreamResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                async for line in response.aiter_lines():
                    _read_line(line, time.perf_counter() - start, out)
                if not out.done and out.error is None:
                    out.error = "stream ended early (no [DONE])"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.e2e_s = time.perf_counter() - start
    return out


def _read_line(line: str, now: float, out: StreamResult) -> None:
    """Fold one SSE line into `out` (comments and other fields are skipped; [DONE] marks
    the stream complete: one that ends without it is an error)."""
    if not line.startswith("data:"):
        return
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        out.done = True
        return
    if not data:
        return
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        out.error = f"unparsable stream event: {data[:200]}"
        return
    if chunk.get("error"):
        out.error = json.dumps(chunk["error"])[:300]
    for choice in chunk.get("choices") or []:
        if _choice_text(choice):
            out.token_times.setdefault(choice.get("index", 0), []).append(now)
    usage = chunk.get("usage")
    if usage:
        out.prompt_tokens = usage.get("prompt_tokens")
        out.completion_tokens = usage.get("completion_tokens")


def make_client(url: str, api_key: str | None, timeout_s: float,
                max_connections: int) -> httpx.AsyncClient:
    """An async client for `url` (the server root, no /v1), proxies from the environment
    ignored so that a local server is reached directly."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=30), trust_env=False)


async def first_model(client: httpx.AsyncClient) -> str:
    """The first id GET /v1/models lists. Raises RuntimeError when there is none."""
    import httpx

    try:
        response = await client.get("/v1/models")
        models = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"GET /v1/models failed: {exc}") from None
    if not models:
        raise RuntimeError(f"GET /v1/models gave no model (HTTP {response.status_code}: "
                           f"{response.text[:200]}); pass --model")
    return models[0]["id"]


async def count_tokens(client: httpx.AsyncClient, model: str, spec: RequestSpec) -> int | None:
    """The prompt's token count from the server's POST /tokenize (chat template included
    for messages), or None when the server has no such route."""
    import httpx

    body: dict[str, Any] = {"model": model}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    try:
        response = await client.post("/tokenize", json=body)
        count = response.json().get("count") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return count if isinstance(count, int) else None
