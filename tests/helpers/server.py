"""Helpers for server tests: a real `plait serve` subprocess shared by the whole session, an
in-process uvicorn server for apps built around a scripted engine, and SSE parsing.

    shared_server()   -> RemoteServer   `python -m plait serve` with the default model,
                                         started once (first use), stopped at exit
    start_server(args, env)            -> RemoteServer   another one, for this test alone
    InProcessServer(app)                 uvicorn in a thread, for create_app(...) apps
                                         (around tests/helpers/scripted.py's engine)
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from plait.bench.launch import ServerProcess, free_port, launch_plait

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-plait-test-key"
STARTUP_TIMEOUT_S = 240.0


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# ---------------------------------------------------------------- real server (subprocess)
@dataclass
class RemoteServer(ServerProcess):
    """A `plait serve` subprocess on 127.0.0.1 (plait/bench/launch.py starts and stops it)
    with the clients, metrics and checks the tests use."""

    api_key: str | None = API_KEY

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120, **kwargs)

    def async_openai(self, **kwargs: Any):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                                  max_retries=0, timeout=120, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {"name{labels}": value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def gauges(self) -> tuple[float, float]:
        """(sub-requests running, sub-requests waiting)."""
        m = self.metrics()
        return m["plait_num_requests_running"], m["plait_num_requests_waiting"]

    def assert_at_rest(self, timeout: float = 30) -> None:
        """Once no sub-request runs or waits (fails if that never comes), no KV block is in
        use: kept prompts name cached blocks, they hold none."""
        assert wait_for(lambda: self.gauges() == (0, 0), timeout), self.gauges()
        m = self.metrics()
        assert (m["plait_kv_blocks_used"], m["plait_kv_cache_usage_perc"]) == (0, 0), m

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        super().wait_healthy(timeout)


def start_server(args: list[str], env: dict[str, str] | None = None,
                 api_key: str | None = None) -> RemoteServer:
    """Start `python -m plait serve --port <free> *args` without the caller's PLAIT_* variables
    (but PLAIT_CACHE), with `env` added; returns before it is healthy."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    full_env.update(env or {})
    if "PLAIT_CACHE" in os.environ:
        full_env["PLAIT_CACHE"] = os.environ["PLAIT_CACHE"]
    launched = launch_plait(args, full_env)
    return RemoteServer(launched.port, launched.process, launched.log_path, api_key=api_key)


_shared: dict[str, RemoteServer] = {}
# The reliability server's small limits (tests/reliability/test_reliability_*.py rely on
# these values).
RELIABILITY = {"max_num_seqs": 4, "max_queued_requests": 8, "max_request_bytes": 65536,
               "max_model_len": 64}


def _session_server(name: str, args: list[str], env: dict[str, str]) -> RemoteServer:
    if name not in _shared:
        server = start_server(args, env, api_key=API_KEY)
        atexit.register(server.stop)
        _shared[name] = server
        server.wait_healthy()
    return _shared[name]


def shared_server() -> RemoteServer:
    """The session's real server: default model, API key, log level and numerics from
    PLAIT_* env vars, a bogus PLAIT_PORT that the --port flag must override. Its numerics
    are exact: the modules that share it compare texts across requests that find different
    prefixes cached (stream against non-stream, n choices against solo runs), which only
    the exact mode computes alike whatever the cache holds; the default (int8) mode is
    served by tests/server/test_server_numerics.py."""
    return _session_server("default", [], {"PLAIT_API_KEY": API_KEY, "PLAIT_PORT": "1",
                                           "PLAIT_LOG_LEVEL": "info",
                                           "PLAIT_NUMERICS": "exact"})


def reliability_server() -> RemoteServer:
    """A second session server: the RELIABILITY limits, --log-prompts, the test-only fault
    injection switch and the API key from a file (both through PLAIT_* env vars)."""
    key_file = Path(tempfile.mkstemp(prefix="plait-keys-")[1])
    key_file.write_text(f"# test keys\n{API_KEY}\n")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in RELIABILITY.items()]
    return _session_server("reliability", [*args, "--log-prompts"], {
        "PLAIT_API_KEY_FILE": str(key_file), "PLAIT_FAULT_INJECTION": "1"})


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The error object of an OpenAI envelope with `status`; fails if a trace or path leaked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body
    assert list(body["error"]) == ["message", "type", "param", "code"], body
    for leak in ("Traceback", ".py", "/srv/", "/work/", "/home/", "site-packages"):
        assert leak not in response.text, response.text
    return body["error"]


# ---------------------------------------------------------------- SSE
@dataclass
class SSE:
    """A parsed event stream: `events` are data payloads (JSON or "[DONE]") in order."""

    raw: bytes
    events: list[Any] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]


def parse_sse(raw: bytes) -> SSE:
    """Strict framing check: every block is `data: ...` or `: comment`, blank-line separated."""
    result = SSE(raw)
    text = raw.decode()
    assert text.endswith("\n\n"), "stream must end with a blank line"
    for block in text[:-2].split("\n\n"):
        assert "\n" not in block, f"one line per event expected: {block!r}"
        if block.startswith(": "):
            result.comments.append(block[2:])
        else:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            result.events.append(data if data == "[DONE]" else json.loads(data))
    return result


# ---------------------------------------------------------------- in-process server
class InProcessServer:
    """Serve an ASGI app with uvicorn in a background thread (a context manager)."""

    def __init__(self, app: Any, sndbuf: int | None = None) -> None:
        """`sndbuf` fixes the kernel send buffer of accepted connections (no autotuning), so
        that a client that stops reading pushes back on the server soon."""
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        sockets = None
        if sndbuf is not None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            sock.bind(("127.0.0.1", self.port))
            sockets = [sock]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        if not wait_for(lambda: self.server.started, 30):
            raise RuntimeError("in-process server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
