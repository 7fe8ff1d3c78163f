"""Fault isolation in a real server, through the test-only fault injection switch
(PLAIT_FAULT_INJECTION=1; markers in the prompt, see server/faults.py): a failing tokenizer,
model step, sampler or detokenizer ends only the request concerned (a 500 envelope, or an
in-stream error event then [DONE]), never leaks a trace or a path, and the server keeps
serving; a dead engine loop turns /health and every new request into an immediate 503."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.requests import GREEDY, chat_body, completion_body
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import (
    API_KEY,
    MODEL,
    InProcessServer,
    RemoteServer,
    error_of,
    parse_sse,
    reliability_server,
    start_server,
    wait_for,
)

LEAKS = ("Traceback", "secret.py", "/srv/", ".py", "injected")


@pytest.fixture(scope="module")
def server() -> RemoteServer:
    return reliability_server()


SHORT = {"max_tokens": 6, **GREEDY}


def _assert_error_event(sse_events: list, message: str) -> None:
    assert sse_events[-1] == "[DONE]"
    assert sse_events[-2] == {"error": {"message": message, "type": "server_error",
                                        "param": None, "code": None}}


@pytest.mark.parametrize(("phase", "message"), [
    ("execute", "internal error while computing the request"),
    ("sample", "internal error while sampling the request"),
    ("detokenize", "internal error while decoding the output")])
def test_engine_fault_ends_only_that_request(server, phase: str, message: str) -> None:
    requests = [("/v1/completions", completion_body(f"plait-fault:{phase} go", SHORT, n=2)),
                ("/v1/completions", completion_body(f"plait-fault:{phase}@5 and then", SHORT)),
                ("/v1/chat/completions", chat_body(f"plait-fault:{phase}@2 count", SHORT,
                                                   stream=True, n=2)),
                ("/v1/completions", completion_body("A healthy request", SHORT))]
    with server.http() as http:
        plain, late, streamed, ok = (http.post(path, json=body) for path, body in requests)
        error = error_of(plain, 500)
        assert (error["type"], error["message"]) == ("server_error", message)
        assert error_of(late, 500)["message"] == message  # after tokens, not streamed
        assert streamed.status_code == 200
        assert not any(leak in streamed.text for leak in LEAKS), streamed.text
        sse = parse_sse(streamed.content)
        _assert_error_event(sse.events, message)
        contents = [c["choices"][0]["delta"].get("content") for c in sse.chunks[:-1]]
        assert contents[:2] == ["", ""] and len([c for c in contents if c]) >= 2
        assert not any(c["choices"][0]["finish_reason"] for c in sse.chunks[:-1])
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    server.assert_at_rest()


async def test_detokenizer_fault_spares_a_concurrent_stream(server: RemoteServer) -> None:
    innocent = chat_body("Name three rivers.", SHORT, max_tokens=12, stream=True)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=120) as client:
        alone = await client.post("/v1/chat/completions", json={**innocent, "stream": False})
        expected = alone.json()["choices"][0]["message"]["content"]

        first_chunk = asyncio.Event()

        async def stream() -> list:
            raw = b""
            async with client.stream("POST", "/v1/chat/completions", json=innocent) as r:
                async for data in r.aiter_bytes():
                    raw += data
                    if b"data: {" in raw:
                        first_chunk.set()
            return parse_sse(raw).events

        task = asyncio.create_task(stream())
        await asyncio.wait_for(first_chunk.wait(), 60)  # the innocent stream is under way
        faulty = await client.post("/v1/completions",
                                   json=completion_body("plait-fault:detokenize@1 x", SHORT, n=3))
        events = await task
    assert error_of(faulty, 500)["type"] == "server_error"
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokenizer_fault_is_a_500_envelope_without_internals(server: RemoteServer) -> None:
    marker = "plait-fault:tokenize"
    with server.http() as http:
        for path, body in (("/v1/chat/completions", chat_body(marker, SHORT)),
                           ("/v1/chat/completions", chat_body(marker, SHORT, stream=True)),
                           ("/v1/completions", completion_body(["fine", marker], SHORT)),
                           ("/tokenize", {"model": MODEL, "prompt": marker})):
            response = http.post(path, json=body, headers={"x-request-id": "fault-1"})
            error = error_of(response, 500)
            assert error["type"] == "server_error" and error["param"] is None
            assert response.headers["x-request-id"] == "fault-1"
            assert not any(leak in response.text for leak in LEAKS)
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", json=chat_body("hello", SHORT)).status_code == 200
    assert "injected tokenizer fault" in server.log()  # the log keeps the details


def test_a_bug_while_streaming_ends_the_stream_with_an_error_event(tokenizer, monkeypatch):
    """In-process (scripted engine): an unexpected exception in the HTTP layer after the
    stream started still ends it with an error event and [DONE]."""
    from plait.server import chat
    from plait.server.app import create_app
    from plait.server.settings import ServerSettings

    def encode(payload: dict) -> bytes:
        if "two" in str(payload):
            raise ValueError("bug at /srv/plait/internal/secret.py")
        return original(payload)

    original = chat.encode
    monkeypatch.setattr(chat, "encode", encode)
    core = ScriptedCore(tokenizer)
    app = create_app(ServerSettings(), engine=scripted_engine(core))
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "max_tokens": 5}
    core.hold()  # a step per token chunk read, so " one" and " two" come as two chunks
    with InProcessServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        core.release(1)
        lines = []
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if '"content":" ' in line:
                    core.release(1)
        core.run_freely()
        assert wait_for(lambda: not core.live, 30)
    text = "\n".join(lines) + "\n"
    assert not any(leak in text for leak in LEAKS)
    events = parse_sse(text.encode()).events
    _assert_error_event(events, "The server had an error while processing your request.")
    assert [e["choices"][0]["delta"] for e in events[:-2]] == [
        {"role": "assistant", "content": ""}, {"content": " one"}]


@pytest.fixture
def doomed_server():
    """A server of its own: this test kills its engine."""
    server = start_server([], {
        "PLAIT_API_KEY": API_KEY, "PLAIT_FAULT_INJECTION": "true"}, api_key=API_KEY)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_dead_engine_loop_turns_everything_503_at_once(doomed_server: RemoteServer) -> None:
    server = doomed_server
    refused = 'plait_requests_refused_total{reason="unavailable"}'
    with server.http() as http:
        body = completion_body("A long story:", SHORT, max_tokens=400, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as victim:
            lines = victim.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            killer = http.post("/v1/completions", json=completion_body("plait-fault:kill", SHORT))
            rest = "\n\n".join(line for line in lines if line) + "\n\n"
        assert error_of(killer, 500)["type"] == "server_error"
        sse = parse_sse(rest.encode())
        _assert_error_event(sse.events, "engine loop died: EngineKilled")
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 30)
        error = error_of(httpx.get(f"{server.url}/health"), 503)
        assert error["code"] == "service_unavailable" and "stopped" in error["message"]
        before = server.metrics()[refused]
        for path, request in (("/v1/completions", completion_body("hi", SHORT)),
                              ("/v1/chat/completions", chat_body("hi", SHORT, stream=True))):
            # A request that waited on the dead engine would hang: 30 s is a liveness limit.
            response = http.post(path, json=request, timeout=30)
            assert error_of(response, 503)["code"] == "service_unavailable"
            assert response.headers["retry-after"]
        assert server.metrics()[refused] - before == 2
    assert server.process.poll() is None  # the process lives on, answering 503s
    assert "engine loop died" in server.log()
