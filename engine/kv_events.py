"""KV-cache events, published over ZeroMQ as vLLM publishes them (`--kv-events-endpoint`).

Prefix-aware routers (the Gateway API Inference Extension's precise-prefix-cache scorer,
NVIDIA Dynamo, the SGLang router) keep an index of which replica caches which blocks. They
follow each replica's events:

    BlockStored       full blocks entered the prefix cache (hashes, parent, token ids)
    BlockRemoved      blocks left it (evicted for a new allocation, or a failed step)
    AllBlocksCleared  the whole cache was reset

The block pool (engine/block_pool.py) records them into a `KVEventLog` as it registers and
drops hashes; the engine core flushes the log once per step (`KVEventPublisher.publish`);
a background thread encodes and sends, so the step only appends to a list and enqueues it.

Wire format (vLLM's `vllm/distributed/kv_events.py`, `ZmqEventPublisher`): each batch is one
ZeroMQ PUB message of three frames, the topic (bytes), the sequence number (8 bytes,
big-endian, from 0, one per batch) and a msgpack `KVEventBatch` `[ts, events,
data_parallel_rank]`. Events are encoded like vLLM's msgspec structs: by default as tagged
maps (`{"type": "BlockStored", "block_hashes": ..., ...}`, vLLM since PR #42892), or, with
`kv_events_encoding="array"`, as tagged arrays (`["BlockStored", block_hashes, ...]`, vLLM
up to 0.23). Block hashes are vLLM's integer form: Plait's 16-byte block hash read as a
big-endian integer, low 64 bits (vLLM's `maybe_convert_block_hash`). Medium is "GPU",
vLLM's name for the engine's own block pool, wherever that pool lives (Plait's is usually
in host memory): "CPU" in vLLM means an offload tier, which routers weigh differently and
which `AllBlocksCleared` does not clear. Only full blocks are published; a prompt's partial
last block (hashed apart, copy-on-write, for kept prompts) is not, as vLLM does not.

A ROUTER replay socket (`--kv-events-replay-endpoint`) answers a request frame holding a
start sequence number (8 bytes, big-endian) with every buffered batch from it on, each as
`[seq, payload]`, then `[-1 (8 bytes, signed), b""]`, exactly as vLLM's publisher.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from plait.engine.config import KV_EVENTS_ENCODINGS as ENCODINGS

logger = logging.getLogger("plait.engine.kv_events")

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(block_hash: bytes) -> int:
    """A Plait block hash as vLLM publishes hashes: big-endian integer, low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")


# ---------------------------------------------------------------- vLLM's structs
# Field names, order and defaults as vLLM's `vllm/distributed/kv_events.py` (EventBatch,
# KVCacheEvent, BlockStored, BlockRemoved, AllBlocksCleared). The batch is array-like in
# every vLLM version; the events are maps (tag field "type") since vLLM PR #42892.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Struct]  # BlockStored | BlockRemoved | AllBlocksCleared
    data_parallel_rank: int | None = None


EventTypes = tuple[type[msgspec.Struct], type[msgspec.Struct], type[msgspec.Struct]]


def _event_types(array_like: bool) -> EventTypes:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


_EVENT_TYPES = {"map": _event_types(False), "array": _event_types(True)}


# ---------------------------------------------------------------- recording
class KVEventLog:
    """The events of the step being run, cheap to record: plain lists of Plait hashes.
    Consecutive stores of one chain (each block's parent the previous one's hash) merge into
    one `BlockStored`, consecutive removals into one `BlockRemoved`, as vLLM batches them."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        # ["S", [hash, ...], parent, [token, ...]] | ["R", [hash, ...]] | ["C"]
        self.pending: list[list[Any]] = []

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last[0] == "S" and last[1][-1] == parent:
            last[1].append(block_hash)
            last[3].extend(token_ids)
        else:
            self.pending.append(["S", [block_hash], parent, list(token_ids)])

    def removed(self, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last[0] == "R":
            last[1].append(block_hash)
        else:
            self.pending.append(["R", [block_hash]])

    def cleared(self) -> None:
        self.pending = [["C"]]  # what came before in this batch no longer matters

    def take(self) -> list[list[Any]]:
        pending, self.pending = self.pending, []
        return pending


def build_events(pending: list[list[Any]], block_size: int,
                 encoding: str = "map") -> list[msgspec.Struct]:
    """The recorded events as vLLM's structs (done on the publisher thread)."""
    stored_t, removed_t, cleared_t = _EVENT_TYPES[encoding]
    # vLLM 0.24+ names the cache group and its kind; the array form leaves them None, as
    # the vLLM versions that published arrays did.
    group, kind = (0, "full_attention") if encoding == "map" else (None, None)
    events: list[msgspec.Struct] = []
    for item in pending:
        if item[0] == "S":
            parent = None if item[2] is None else external_hash(item[2])
            events.append(stored_t(
                block_hashes=[external_hash(h) for h in item[1]], parent_block_hash=parent,
                token_ids=item[3], block_size=block_size, lora_id=None, medium=MEDIUM,
                lora_name=None, group_idx=group, kv_cache_spec_kind=kind))
        elif item[0] == "R":
            events.append(removed_t(block_hashes=[external_hash(h) for h in item[1]],
                                    medium=MEDIUM, group_idx=group))
        else:
            events.append(cleared_t())
    return events


# ---------------------------------------------------------------- publishing
class KVEventPublisher:
    """XPUB socket (+ optional ROUTER replay socket) fed by a bounded queue and one thread.

    `publish` never blocks the step: if the thread falls `max_queue` batches behind, a
    batch is dropped and counted (`dropped`); its sequence number is still used, so
    subscribers see the gap. Sockets are bound (or connected, as vLLM: an endpoint without
    `*`, `::`, ipc:// or inproc:// connects) in the constructor, so a busy port fails the
    engine's start rather than a later step.

    A PUB socket drops every message that no subscription it knows of matches, and a
    subscriber's subscription reaches the publisher only once the subscriber's socket has
    run its commands (a recv or poll after the connection came up). So a router that binds
    and lets Plait connect (vLLM's "connect" form, as llm-d configures it) would miss every
    batch sent before its first recv, and one that is not reading yet would miss them all.
    The XPUB socket sees the subscriptions: while none matches `topic`, batches are held (at
    most `buffer_steps`, the oldest dropped and counted beyond that) and sent, in order, as
    soon as one arrives. Later subscribers catch up through the replay socket, as in vLLM."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 block_size: int = 16, encoding: str = "map", buffer_steps: int = 10_000,
                 hwm: int = 100_000, max_queue: int = 100_000,
                 data_parallel_rank: int = 0) -> None:
        import zmq  # only with --kv-events-endpoint

        if encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {ENCODINGS}")
        self.block_size = block_size
        self.encoding = encoding
        self.rank = data_parallel_rank
        self.topic = topic.encode()
        self.dropped = 0  # batches never sent (queue full, or held past `buffer_steps`)
        self._seq = 0
        self._queue: queue.Queue[tuple[int, float, list[list[Any]]] | None] = queue.Queue(
            max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._held: deque[tuple[int, bytes]] = deque()  # sent once a subscription matches
        self._max_held = buffer_steps
        self._subscriptions: set[bytes] = set()  # prefixes matching `topic`
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            if ("*" in endpoint or "::" in endpoint
                    or endpoint.startswith(("ipc://", "inproc://"))):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot open the KV events socket: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="plait-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (topic %r%s)", endpoint, topic,
                    f", replay on {replay_endpoint}" if replay_endpoint else "")

    def publish(self, pending: list[list[Any]]) -> None:
        """Queue one step's events (a no-op for none)."""
        if not pending:
            return
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), pending))
        except queue.Full:
            self._drop("the publisher is behind")

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1:
            logger.warning("KV events: dropping batches (%s; a gap in sequence numbers tells "
                           "subscribers, and plait_kv_events_dropped_total counts them)", why)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)
        self._ctx.term()

    def encode(self, ts: float, pending: list[list[Any]]) -> bytes:
        batch = EventBatch(ts, build_events(pending, self.block_size, self.encoding),
                           self.rank)
        return msgspec.msgpack.encode(batch)

    def _run(self) -> None:
        while True:
            self._take_subscriptions()
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV events replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, pending = item
            try:
                payload = self.encode(ts, pending)
                self._buffer.append((seq, payload))
                if self._subscriptions:
                    self._send(seq, payload)
                else:
                    if len(self._held) == self._max_held:
                        self._held.popleft()
                        self._drop("no subscriber took them")
                    self._held.append((seq, payload))
            except Exception:
                logger.exception("publishing KV events failed")

    def _take_subscriptions(self) -> None:
        """Read the XPUB's (un)subscription messages (b"\\x01" or b"\\x00" + prefix); send
        what is held once one matches the topic."""
        while self._pub.poll(0):
            message = self._pub.recv()
            if not message or not self.topic.startswith(message[1:]):
                continue
            if message[0] == 1:
                self._subscriptions.add(message[1:])
            else:
                self._subscriptions.discard(message[1:])
        while self._subscriptions and self._held:
            self._send(*self._held.popleft())

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
