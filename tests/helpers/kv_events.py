"""A router's side of the KV-cache events (engine/kv_events.py), for tests/engine/test_kv_events.py
and tests/server/test_two_replicas.py: a plain pyzmq SUB socket + msgpack, and an index of the
cached blocks the events describe.

    Subscriber(topic)     SUB socket bound on 127.0.0.1; settle() once the publisher connected,
                          receive(until) batches until a condition holds, replay(endpoint, start)
    Index                 hash -> (parent, tokens) from BlockStored / BlockRemoved / cleared

Nothing here waits for a quiet period: `settle` waits for the ZMTP handshake (a socket
monitor), `receive` for a condition the caller states (a sequence number reached, a prefix
cached), `wait_disconnected` for the publisher's close, each under a liveness limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from plait.bench.launch import free_port

END_SEQ = (-1).to_bytes(8, "big", signed=True)
LIVENESS_S = 30.0


class Subscriber:
    """A SUB socket bound on 127.0.0.1 (the engine's PUB connects to it, vLLM's "connect"
    form of the endpoint), plus replay requests to the engine's ROUTER socket. `live` holds
    every batch received, in order, as (seq, decoded batch)."""

    def __init__(self, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.monitor = self.sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.port = free_port()
        self.sub.bind(f"tcp://127.0.0.1:{self.port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.live: list[tuple[int, Any]] = []
        self.topics: set[bytes] = set()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _wait_event(self, event: int, timeout: float) -> None:
        """Until the monitor reports `event`. Polling the SUB socket meanwhile makes it take
        the new connection and send its subscription (a socket runs its commands only
        when called); messages stay queued for `receive`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sub.getsockopt(zmq.EVENTS)
            if self.monitor.poll(20) and recv_monitor_message(self.monitor)["event"] == event:
                self.sub.getsockopt(zmq.EVENTS)
                return
        raise AssertionError(f"no zmq event {event} within {timeout:.0f} s")

    def settle(self, timeout: float = LIVENESS_S) -> None:
        """Return once the publisher connected (its handshake succeeded) and the socket sent
        it the subscription."""
        self._wait_event(zmq.EVENT_HANDSHAKE_SUCCEEDED, timeout)

    def wait_disconnected(self, timeout: float = LIVENESS_S) -> None:
        """Return once the publisher closed its connection: everything it sent is queued
        here (TCP delivers the close after the data)."""
        self._wait_event(zmq.EVENT_DISCONNECTED, timeout)

    def receive(self, until: Callable[[], bool] = lambda: True,
                timeout: float = LIVENESS_S) -> list[tuple[int, Any]]:
        """Take every batch already queued, then go on receiving until `until()` holds
        (fails after `timeout` seconds); the batches received."""
        got: list[tuple[int, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            while self.sub.poll(0):
                topic, seq, payload = self.sub.recv_multipart()
                self.topics.add(topic)
                batch = (int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))
                got.append(batch)
                self.live.append(batch)
            if until():
                return got
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"condition not met within {timeout:.0f} s: {got}"
            self.sub.poll(int(min(remaining, 1.0) * 1000))

    def receive_upto(self, num_batches: int) -> list[tuple[int, Any]]:
        """Receive until the batch numbered `num_batches - 1` arrived (sequence numbers
        count from 0): every batch a publisher that numbered `num_batches` sent."""
        return self.receive(lambda: bool(num_batches == 0 or (self.live
                                         and self.live[-1][0] >= num_batches - 1)))

    def replay(self, endpoint: str, start: int) -> list[tuple[int, Any]]:
        """Ask the replay socket for every batch from `start` (a DEALER: one request, many
        replies, each [empty delimiter, seq, payload], then the end marker)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(int(LIVENESS_S * 1000)), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        dealer.close(linger=0)
        return got

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()


class Index:
    """A replica's cached blocks as its events describe them: hash -> (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}
        self.stored: list[int] = []  # every stored hash, in order (with repeats)
        self.removed: list[int] = []
        self.clears = 0

    def apply(self, batch: list[Any]) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                size = event["block_size"]
                tokens = event["token_ids"]
                assert len(tokens) == size * len(event["block_hashes"])
                assert event["medium"] == "GPU"
                parent = event["parent_block_hash"]
                for i, h in enumerate(event["block_hashes"]):
                    assert h not in self.blocks, "a cached block stored again"
                    self.blocks[h] = (parent, tokens[i * size:(i + 1) * size])
                    self.stored.append(h)
                    parent = h
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    assert h in self.blocks, "a block removed that was never stored"
                    del self.blocks[h]
                    self.removed.append(h)
            else:
                assert kind == "AllBlocksCleared"
                self.blocks.clear()
                self.clears += 1

    def prefix(self, h: int) -> list[int]:
        """The token ids from the sequence start to the end of block `h`."""
        parts = []
        node: int | None = h
        while node is not None:
            parent, tokens = self.blocks[node]
            parts.append(tokens)
            node = parent
        return [t for part in reversed(parts) for t in part]

    def prefixes(self) -> set[tuple[int, ...]]:
        return {tuple(self.prefix(h)) for h in self.blocks}
