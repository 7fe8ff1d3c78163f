"""Slow and vanished clients. A client that stops reading never holds up the engine or other
streams, its pending output coalesces (one delta per choice, however many steps ran), and it
still gets the complete text; a client that hangs up during a long prefill aborts every
choice before any token and frees every block."""

from __future__ import annotations

import http.client
import json
import socket
import uuid

import httpx
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import (
    MODEL,
    InProcessServer,
    RemoteServer,
    parse_sse,
    wait_for,
)

from plait.server.app import create_app
from plait.server.settings import ServerSettings


def _send_without_reading(port: int, path: str, body: dict,
                          headers: dict[str, str]) -> http.client.HTTPConnection:
    """Send a request on a socket with a tiny receive buffer and read nothing yet."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    conn.sock = sock
    conn.request("POST", path, json.dumps(body),
                 {"Content-Type": "application/json", **headers})
    return conn


def _content(events: list) -> tuple[str, list[str]]:
    """The joined text of a one-choice chat stream, and each chunk's piece."""
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events
              if isinstance(e, dict) and e.get("choices")]
    return "".join(pieces), [p for p in pieces if p]


def test_slow_reader_coalesces_and_blocks_no_one(tokenizer) -> None:
    core = ScriptedCore(tokenizer)
    app = create_app(ServerSettings(), engine=scripted_engine(core))
    num_tokens = 2000
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "max_tokens": num_tokens}
    with InProcessServer(app, sndbuf=4096) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        slow = _send_without_reading(server.port, "/v1/chat/completions", body, {})
        # The engine runs the slow request to its end while nothing is read...
        assert wait_for(lambda: core.added and not core.live, 30)
        # ...and another client streams as usual meanwhile (were it blocked behind the
        # unread stream, it would never finish: the client's timeout is the liveness limit).
        fast = parse_sse(http.post("/v1/chat/completions",
                                   json={**body, "max_tokens": 3}).content)
        assert fast.events[-1] == "[DONE]" and _content(fast.events)[0] == " one two three"
        raw = slow.getresponse().read()
        slow.close()
    text, pieces = _content(parse_sse(raw).events)
    script = core.script
    assert text == "".join(tokenizer.decode([script[i % len(script)]])
                           for i in range(num_tokens))
    # Without coalescing every token would be a chunk of its own.
    assert len(pieces) < num_tokens / 2, len(pieces)
    assert core.aborted == []


def test_slow_reader_of_a_real_server_gets_the_exact_text(server: RemoteServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a forest."}],
            "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with server.http() as http:
        reference = http.post("/v1/chat/completions", json=body).json()
        expected = reference["choices"][0]["message"]["content"]
        generated = server.metrics()["plait_generation_tokens_total"]
        slow = _send_without_reading(server.port, "/v1/chat/completions",
                                     {**body, "stream": True}, server.headers)
        # Served while the slow stream stays unread (the client's timeout is the limit).
        fast = http.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4,
            "stream": True})
        assert parse_sse(fast.content).events[-1] == "[DONE]"
        # The engine finished the slow stream's tokens although nobody read them.
        assert wait_for(lambda: server.metrics()["plait_generation_tokens_total"]
                        - generated == 44 and server.gauges() == (0, 0), 60)
    sse = parse_sse(slow.getresponse().read())
    slow.close()
    assert sse.events[-1] == "[DONE]"
    assert _content(sse.events)[0] == expected
    assert sse.chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_hang_up_during_a_long_prefill_aborts_before_any_token(server) -> None:
    prompt = f"{uuid.uuid4().hex} " + "lorem ipsum " * 1100  # three prefill steps
    with server.http() as http:
        num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert 4096 < num_prompt < 6144  # --max-num-batched-tokens 2048: three prefill steps
    assert wait_for(lambda: server.gauges() == (0, 0), 30)
    before = server.metrics()
    conn = _send_without_reading(server.port, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 50, "stream": True},
        server.headers)
    computed = "plait_prompt_tokens_computed_total"  # the stats refresh after each step

    def moved(name: str) -> float:
        return server.metrics()[name] - before[name]

    # The first prefill step is done (its stats are in) and the second one has begun.
    assert wait_for(lambda: moved(computed) == 2048, 120), moved(computed)
    conn.sock.close()
    conn.close()

    def settled() -> bool:  # every choice aborted, and its blocks back in the pool
        m = server.metrics()
        return (m["plait_num_requests_running"], m["plait_num_requests_waiting"],
                m["plait_kv_blocks_used"]) == (0, 0, before["plait_kv_blocks_used"])

    assert wait_for(settled, 60), server.gauges()
    after = server.metrics()
    assert after["plait_generation_tokens_total"] == before["plait_generation_tokens_total"]
    # The step under way when the client hung up finishes; no third one starts.
    assert after[computed] - before[computed] == 4096
