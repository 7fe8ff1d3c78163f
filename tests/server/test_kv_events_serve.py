"""KV-cache events through a real `plait serve`, in both ZeroMQ socket modes, with the engine
in its own process and in a thread:

    connect  `--kv-events-endpoint tcp://127.0.0.1:PORT`: the router binds a SUB socket and
             Plait connects to it (how llm-d's guides configure vLLM). The router here
             subscribes with a topic prefix and does not touch its socket until the request
             is done, so its subscription reaches Plait only then: every batch must still
             arrive, from sequence number 0 (engine/kv_events.py holds them until then).
    bind     `--kv-events-endpoint tcp://*:PORT`: Plait binds, the router connects.

Each test checks the events cover the prompt's full blocks and that
`plait_kv_events_dropped_total` on /metrics is 0.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq
from helpers.server import RemoteServer, start_server

from plait.bench.launch import free_port

BLOCK = 16
TOPIC = "kv@replica-a@tiny"
PROMPT = list(range(5, 5 + 3 * BLOCK + 5))  # three full blocks and a partial one


def _serve(tiny_path, endpoint: str, engine_process: bool) -> RemoteServer:
    args = [str(tiny_path), "--block-size", str(BLOCK), "--num-kv-blocks", "256",
            "--served-model-name", "tiny", "--kv-events-endpoint", endpoint,
            "--kv-events-topic", TOPIC]
    server = start_server(args if engine_process else [*args, "--no-engine-process"])
    server.wait_healthy()
    return server


def _complete(server: RemoteServer) -> None:
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                               "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text


def _receive_stored(sub: zmq.Socket, num_blocks: int) -> list[tuple[int, list[int]]]:
    """(seq, token ids stored) of each batch, until `num_blocks` blocks were stored."""
    got: list[tuple[int, list[int]]] = []
    while sum(len(tokens) for _, tokens in got) < num_blocks * BLOCK:
        assert sub.poll(30_000), f"the events stopped after {got}"
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        _, events, _ = msgspec.msgpack.decode(payload)
        tokens = [t for e in events if e["type"] == "BlockStored" for t in e["token_ids"]]
        got.append((int.from_bytes(seq, "big"), tokens))
    return got


@pytest.mark.parametrize("engine_process", [True, False], ids=["process", "thread"])
@pytest.mark.parametrize("mode", ["connect", "bind"])
def test_events_arrive_through_plait_serve(tiny_path, mode: str, engine_process: bool) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    if mode == "connect":
        sub.bind(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        server = _serve(tiny_path, f"tcp://127.0.0.1:{port}", engine_process)
    else:
        server = _serve(tiny_path, f"tcp://*:{port}", engine_process)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        _complete(server)  # `sub` has not been read or polled since the server started
        got = _receive_stored(sub, 3)
        assert [seq for seq, _ in got] == list(range(len(got)))
        # the prompt's full blocks, in order
        stored = [t for _, tokens in got for t in tokens]
        assert stored[:3 * BLOCK] == PROMPT[:3 * BLOCK]
        assert server.metrics()["plait_kv_events_dropped_total"] == 0
    finally:
        server.stop()
        sub.close(linger=0)
        ctx.term()
