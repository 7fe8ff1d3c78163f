"""The app around a real AsyncEngine with a scripted core, served by uvicorn in a thread:
lifecycle (/health), auth, pings, engine failures, disconnect aborts, CORS, 500s."""

from __future__ import annotations

import http.client as http_client
import json
import threading

import httpx
import openai
import pytest
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import (
    InProcessServer,
    free_port,
    parse_sse,
    wait_for,
)

from plait.server.app import create_app
from plait.server.settings import ServerSettings

MODEL = "scripted-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def core(tokenizer) -> ScriptedCore:
    return ScriptedCore(tokenizer)


def serve(core: ScriptedCore, gate: threading.Event | None = None, **settings) -> tuple:
    engine = scripted_engine(core, gate)
    app = create_app(ServerSettings(**settings), engine=engine)
    return InProcessServer(app), app, engine


def assert_envelope(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert "Traceback" not in response.text and ".py" not in response.text
    assert response.headers["x-request-id"]
    return body["error"]


def test_health_is_503_while_loading_200_when_ready_503_when_the_engine_dies(core) -> None:
    gate = threading.Event()
    server, _, engine = serve(core, gate)
    with server, httpx.Client(base_url=server.url) as http:
        assert_envelope(http.get("/health"), 503, "service_unavailable")
        assert "loading" in http.get("/health").json()["error"]["message"]
        assert_envelope(http.post("/v1/chat/completions", json=CHAT), 503, "service_unavailable")
        assert http.get("/version").status_code == 200  # the socket listens during the load
        gate.set()
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        assert http.get("/health").json() == {"status": "ok"}
        core.die = True  # the engine loop dies on its next iteration
        assert wait_for(lambda: http.get("/health").status_code == 503, 30)
        assert not engine.healthy
        assert "stopped" in assert_envelope(http.post("/v1/chat/completions", json=CHAT), 503,
                                            "service_unavailable")["message"]


def test_failed_load_is_reported_once_and_health_stays_503(tokenizer) -> None:
    from plait.engine.async_engine import AsyncEngine
    from plait.engine.config import EngineConfig

    def broken(_):
        raise FileNotFoundError("/secret/path/model.gguf")

    errors: list[str] = []
    app = create_app(ServerSettings(), AsyncEngine(EngineConfig(), core_factory=broken),
                     on_load_error=errors.append)
    with InProcessServer(app) as server, httpx.Client(base_url=server.url) as http:
        assert wait_for(lambda: errors, 30)
        error = assert_envelope(http.get("/health"), 503, "service_unavailable")
        assert "failed to load" in error["message"]
        assert "/secret" not in http.get("/health").text
    assert errors == ["FileNotFoundError: /secret/path/model.gguf"]


def test_api_keys_guard_the_api_but_not_health_metrics_version(core) -> None:
    server, _, _ = serve(core, api_keys=("key-one", "key-two"))
    with server, httpx.Client(base_url=server.url) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200, path
        missing = assert_envelope(http.get("/v1/models"), 401)
        assert missing["message"].startswith("You didn't provide an API key")
        assert_envelope(http.post("/tokenize", json={"prompt": "x"}), 401)
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer key-three"})
        assert_envelope(wrong, 401, "invalid_api_key")
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert_envelope(http.get("/v1/models", headers={"Authorization": "key-one"}), 401)
        for key in ("key-one", "key-two"):
            ok = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


def test_idle_stream_gets_ping_comments(core) -> None:
    core.hold()  # no token until two pings came
    server, _, _ = serve(core, sse_ping_interval=0.15)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        body = {**CHAT, "stream": True, "max_tokens": 2}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if lines.count(": ping") == 2:
                    core.release(2)
        sse = parse_sse(("\n".join(lines) + "\n").encode())
    assert sse.comments[:2] == ["ping", "ping"] and set(sse.comments) == {"ping"}
    assert core.num_steps == 2
    assert sse.events[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in sse.chunks][-1] == "length"


def test_engine_error_mid_stream_is_an_error_event_then_done(core) -> None:
    core.fail_after = 2
    core.hold()  # a step per token chunk read, so the failure merges with no token
    server, _, _ = serve(core)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        core.release(1)  # the first step: the response starts with its chunks
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as (
                response):
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if '"content":" ' in line:
                    core.release(1)
        raw = ("\n".join(lines) + "\n").encode()
        sse = parse_sse(raw)
        assert sse.events[-1] == "[DONE]"
        assert sse.events[-2] == {"error": {"message": "scripted engine failure",
                                            "type": "server_error", "param": None,
                                            "code": None}}
        contents = [c["choices"][0]["delta"].get("content") for c in sse.chunks[:-1]]
        assert contents == ["", " one", " two"]  # no finish chunk, no "abort" ever
        assert b"abort" not in raw
        # The SDK raises it mid-iteration (the first token started the stream).
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        core.release(1)
        stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                stream=True)
        with pytest.raises(openai.APIError, match="scripted engine failure"):
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    core.release(1)


def test_tokens_merged_into_a_failure_are_streamed_before_the_error_event(core) -> None:
    """A reader that fell behind gets the failure merged with the tokens before it: those
    tokens are still sent, then the error event."""
    core.fail_after, core.fail_with_token = 2, True
    core.hold()
    server, _, _ = serve(core)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        core.release(1)
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as (
                response):
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if '"content":" one"' in line:
                    core.release(2)  # " two", then the failure carrying " three"
        sse = parse_sse(("\n".join(lines) + "\n").encode())
    assert sse.events[-2:] == [{"error": {"message": "scripted engine failure",
                                          "type": "server_error", "param": None,
                                          "code": None}}, "[DONE]"]
    contents = [c["choices"][0]["delta"].get("content") or "" for c in sse.chunks[:-1]]
    assert "".join(contents) == " one two three"
    assert all(c["choices"][0]["finish_reason"] is None for c in sse.chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_before_the_first_byte_is_a_500_envelope(core, stream: bool) -> None:
    core.reject = True
    server, _, _ = serve(core)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        response = http.post("/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "n": 2, "stream": stream})
        error = assert_envelope(response, 500)
        assert error["type"] == "server_error" and error["message"] == "scripted rejection"


def test_stream_disconnect_aborts_every_choice_at_once(core) -> None:
    core.hold()  # one step only: the four choices stay in flight until the client leaves
    server, _, engine = serve(core)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        body = {**CHAT, "stream": True, "n": 4, "max_tokens": 10_000}
        core.release(1)  # the first step: the response starts with its chunks
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            firsts = 0
            for line in response.iter_lines():
                firsts += '"content":" one"' in line
                if firsts == 4:
                    break
        assert wait_for(lambda: len(core.aborted) == 4 and not core.live, 30), core.aborted
        assert sorted(core.aborted) == sorted(core.added)
        assert {rid.rsplit("-", 1)[1] for rid in core.added} == {"0", "1", "2", "3"}
        assert core.num_steps == 1
        assert wait_for(lambda: engine.num_queued == 0, 30)


def test_non_streaming_disconnect_aborts(core) -> None:
    core.hold()  # no step: the three choices stay in flight until the client leaves
    server, _, engine = serve(core)
    with server, httpx.Client(base_url=server.url) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        body = json.dumps({"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 10_000})
        client = http_client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        client.request("POST", "/v1/completions", body=body,
                       headers={"Content-Type": "application/json"})
        assert wait_for(lambda: len(core.added) == 3, 30)
        client.close()  # hang up without reading
        assert wait_for(lambda: len(core.aborted) == 3 and not core.live, 30), core.aborted
        assert sorted(core.aborted) == sorted(core.added) and core.num_steps == 0
        assert wait_for(lambda: engine.num_queued == 0, 30)


def test_cors_preflight_honours_allowed_origins(core) -> None:
    server, _, _ = serve(core, allowed_origins=("https://app.example",),
                         allowed_methods=("POST",), api_keys=("k",))
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with server, httpx.Client(base_url=server.url) as http:
        ok = http.options("/v1/chat/completions",
                          headers={"Origin": "https://app.example", **preflight})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert ok.headers["x-request-id"]
        denied = http.options("/v1/chat/completions",
                              headers={"Origin": "https://evil.example", **preflight})
        assert denied.status_code == 400
        assert "access-control-allow-origin" not in denied.headers


def test_unexpected_exception_is_a_500_envelope_with_request_id(core) -> None:
    server, app, _ = serve(core)

    def explode() -> bytes:
        raise RuntimeError("boom at /work/main/server/metrics.py")

    app.state.plait.metrics.render = explode
    with server, httpx.Client(base_url=server.url) as http:
        response = http.get("/metrics", headers={"x-request-id": "trace-42"})
        error = assert_envelope(response, 500)
        assert error["type"] == "server_error" and "boom" not in response.text
        assert response.headers["x-request-id"] == "trace-42"


def test_request_ids_are_echoed_or_generated(core) -> None:
    server, _, _ = serve(core)
    with server, httpx.Client(base_url=server.url) as http:
        assert http.get("/version", headers={"x-request-id": "abc-123"}).headers[
            "x-request-id"] == "abc-123"
        generated = {http.get("/version").headers["x-request-id"] for _ in range(3)}
        assert len(generated) == 3 and all(len(g) == 32 for g in generated)
        bad = http.get("/version", headers={"x-request-id": "has space"})
        assert bad.headers["x-request-id"] != "has space"
        assert_envelope(http.get("/nope", headers={"x-request-id": "e-1"}), 404, "not_found")
        assert_envelope(http.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_merged_stream_keeps_one_role_and_one_finish_per_index(core) -> None:
    """Scripted tokens make exact chunk contents checkable for n=3. The next step runs once
    the three chunks of the last one were read, so no two tokens merge into one chunk."""
    core.hold()
    server, _, _ = serve(core)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        body = {**CHAT, "stream": True, "n": 3, "max_tokens": 3}
        core.release(1)  # the first step: the response starts with its chunks
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines, num_tokens = [], 0
            for line in response.iter_lines():
                lines.append(line)
                num_tokens += '"content":" ' in line
                if '"content":" ' in line and num_tokens % 3 == 0:
                    core.release(1)
        sse = parse_sse(("\n".join(lines) + "\n").encode())
    per_index: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for chunk in sse.chunks:
        (choice,) = chunk["choices"]
        per_index[choice["index"]].append(choice)
    for choices in per_index.values():
        assert [c["delta"] for c in choices] == [
            {"role": "assistant", "content": ""}, {"content": " one"}, {"content": " two"},
            {"content": " three"}, {}]
        assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]


class DrainingThread:
    """`DrainingServer` (what `plait serve` runs) around a scripted engine, in a thread;
    `signal()` calls its handler as uvicorn's signal handler would."""

    def __init__(self, core: ScriptedCore, drain_timeout: float) -> None:
        import uvicorn

        from plait.server.serve import CLOSE_TIMEOUT_S, DrainingServer

        self.app = create_app(ServerSettings(drain_timeout=drain_timeout),
                              engine=scripted_engine(core))
        port = free_port()
        self.server = DrainingServer(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                           timeout_graceful_shutdown=CLOSE_TIMEOUT_S), self.app.state.plait)
        self.url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> DrainingThread:
        self.thread.start()
        assert wait_for(lambda: self.server.started, 30)
        assert wait_for(lambda: httpx.get(f"{self.url}/health").status_code == 200, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def signal(self) -> None:
        import signal

        self.server.handle_exit(signal.SIGTERM, None)


def test_sigterm_drains_in_flight_streams_then_exits(core) -> None:
    """While the drain waits for the streams, the listener stays open: readiness is 503,
    liveness 200, new work 503; the streams finish normally and the server then stops."""
    core.hold()  # the streams are mid-way when SIGTERM comes
    with DrainingThread(core, drain_timeout=20) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http, \
            httpx.Client(base_url=server.url, timeout=30) as probe:
        body = {**CHAT, "stream": True, "n": 2, "max_tokens": 20}
        core.release(1)  # the first step: the response starts with its chunks
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            head = [next(lines) for _ in range(4)]
            server.signal()
            assert server.app.state.plait.draining
            health = probe.get("/health")  # a new connection: answered, not refused
            assert_envelope(health, 503, "service_unavailable")
            assert "shutting down" in health.json()["error"]["message"]
            assert probe.get("/live").json() == {"status": "ok"}
            assert_envelope(probe.post("/v1/chat/completions", json=CHAT), 503,
                            "service_unavailable")
            assert core.live and core.num_steps == 1  # both choices are still running
            assert server.thread.is_alive()
            core.release(19)
            rest = "\n".join(lines)
        server.thread.join(30)
        assert not server.thread.is_alive()  # it stopped once the last stream ended
    sse = parse_sse(("\n".join(head) + "\n" + rest + "\n").encode())
    assert sse.events[-1] == "[DONE]"
    assert sorted(c["choices"][0]["index"] for c in sse.chunks
                  if c["choices"][0]["finish_reason"] == "length") == [0, 1]
    assert core.aborted == []


def test_a_stream_past_the_drain_time_ends_with_an_error_event_and_done(
        core, caplog: pytest.LogCaptureFixture) -> None:
    """The drain time runs out with a stream still running: it ends with an error event
    and [DONE] (no cancelled task, no traceback), the engine is asked to drop the
    sub-requests, and the server stops."""
    from plait.server.serve import DRAIN_MESSAGE

    core.hold()
    with DrainingThread(core, drain_timeout=0.5) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        body = {**CHAT, "stream": True, "n": 2, "max_tokens": 20}
        core.release(1)
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            head = [next(lines) for _ in range(4)]
            server.signal()
            rest = "\n".join(lines)  # the engine never steps again: only the cut ends it
        server.thread.join(30)
        assert not server.thread.is_alive()
    sse = parse_sse(("\n".join(head) + "\n" + rest + "\n").encode())
    assert sse.events[-1] == "[DONE]"
    errors = [chunk["error"] for chunk in sse.chunks if "error" in chunk]
    assert errors == [{"message": DRAIN_MESSAGE, "type": "server_error", "param": None,
                       "code": None}]
    assert wait_for(lambda: sorted(core.aborted) == sorted(core.added), 10)
    assert len(core.added) == 2
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]


def test_a_second_signal_ends_the_drain_at_once(core) -> None:
    core.hold()
    with DrainingThread(core, drain_timeout=600) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        core.release(1)
        with http.stream("POST", "/v1/chat/completions",
                         json={**CHAT, "stream": True, "max_tokens": 20}) as response:
            lines = response.iter_lines()
            next(lines)
            server.signal()
            server.signal()
            rest = "\n".join(lines)
        server.thread.join(30)
        assert not server.thread.is_alive()
    assert rest.rstrip().endswith("data: [DONE]") and "shutting down" in rest
