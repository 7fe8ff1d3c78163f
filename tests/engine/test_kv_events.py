"""KV-cache events (engine/kv_events.py), read by a plain pyzmq SUB socket + msgpack.

The engine publishes as vLLM does: frames [topic, seq (8 bytes big-endian), msgpack batch
[ts, events, data_parallel_rank]]. `Subscriber` (tests/helpers/kv_events.py) is what
a router would run; `Index` applies the events (stored, removed, cleared) and rebuilds each
cached block's token prefix along the parent links. Also: the payload decoded by msgspec
structs written here after vLLM's definitions (`vllm/distributed/kv_events.py`), in both encodings.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from helpers.engine import make_llm, prompt
from helpers.kv_events import Index, Subscriber

from plait import SamplingParams
from plait.bench.launch import free_port
from plait.engine.config import EngineConfig
from plait.engine.kv_events import KVEventLog, KVEventPublisher, external_hash

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def published_hashes(llm) -> set[int]:
    """The engine's own view: hashes of the full blocks in its prefix cache."""
    return {external_hash(h) for h, b in llm.engine.pool.cached.items() if b.published}


def published(llm) -> int:
    """How many batches the engine's publisher numbered so far (it numbers them as the step
    queues them, so after generate() returns this is final)."""
    return llm.engine.kv_events._seq


def apply_all(index: Index, batches: list[tuple[int, Any]]) -> None:
    for _, batch in batches:
        index.apply(batch)


def assert_consecutive(batches: list[tuple[int, Any]], start: int = 0) -> None:
    assert [seq for seq, _ in batches] == list(range(start, start + len(batches)))


@pytest.fixture
def sub():
    subscriber = Subscriber()
    yield subscriber
    subscriber.close()


def events_llm(tiny_path, sub: Subscriber, **options):
    """An LLM (blocks of 4) publishing to `sub`, connected and subscribed before the first
    step."""
    llm = make_llm(tiny_path, kv_events_endpoint=sub.endpoint, **options)
    sub.settle()
    return llm


# ---------------------------------------------------------------- engine-level tests
def test_events_off_by_default(tiny_path) -> None:
    llm = make_llm(tiny_path)
    assert llm.engine.pool.events is None and llm.engine.kv_events is None


def test_n_choices_store_the_prompt_blocks_once(tiny_path, sub) -> None:
    llm = events_llm(tiny_path, sub, kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    ids = prompt(1, 10)  # two full blocks of 4, a partial one (not published)
    out = llm.generate([ids], SamplingParams(n=4, max_tokens=1, temperature=0.8, seed=1))
    assert len(out[0].outputs) == 4
    index = Index()
    batches = sub.receive_upto(published(llm))
    assert_consecutive(batches)
    apply_all(index, batches)
    assert len(index.stored) == 2 and not index.removed
    assert sorted(index.prefixes()) == [tuple(ids[:4]), tuple(ids[:8])]
    assert set(index.blocks) == published_hashes(llm)
    # the same prompt again hits the cache: nothing new is stored
    num_batches = published(llm)
    llm.generate([ids], SamplingParams(n=4, max_tokens=1, temperature=0.8, seed=2))
    assert published(llm) == num_batches and sub.receive() == []
    llm.engine.close()


def test_token_ids_rebuild_the_cached_prefixes(tiny_path, sub) -> None:
    llm = events_llm(tiny_path, sub)
    base = prompt(2, 9)
    prompts = [base, base[:8] + prompt(3, 7), prompt(4, 13), base + prompt(5, 4)]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    outs = llm.generate(prompts, params)
    index = Index()
    batches = sub.receive_upto(published(llm))
    assert_consecutive(batches)
    apply_all(index, batches)
    assert set(index.blocks) == published_hashes(llm)
    # every block's prefix is the start of one sequence (prompt + generated tokens)...
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    for pre in index.prefixes():
        assert any(tuple(s[:len(pre)]) == pre for s in seqs), pre
    # ...and every full block whose K/V was computed (the last sampled token never is) is
    # cached, so the prefixes are exactly those
    expected = {tuple(s[:k]) for s in seqs for k in range(4, len(s), 4)}
    assert index.prefixes() == expected
    assert len(index.stored) == len(expected)  # the shared first blocks were stored once
    llm.engine.close()


def test_evictions_under_pressure_are_removed(tiny_path, sub) -> None:
    llm = events_llm(tiny_path, sub, num_kv_blocks=8)  # 32 tokens of cache
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    index = Index()
    for seed in range(6):  # 6 prompts of 12 (+4) tokens: the cache evicts
        llm.generate([prompt(10 + seed, 12)], params)
        apply_all(index, sub.receive_upto(published(llm)))
    assert index.removed, "no eviction was published"
    assert set(index.removed) <= set(index.stored)
    assert set(index.blocks) == published_hashes(llm)
    assert_consecutive(sub.live)
    llm.engine.close()


def test_replay_returns_missed_batches(tiny_path, sub) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    llm = events_llm(tiny_path, sub, kv_events_replay_endpoint=replay,
                     kv_events_topic="plait-kv")
    params = SamplingParams(temperature=0, max_tokens=2)
    for seed in range(4):
        llm.generate([prompt(30 + seed, 9)], params)
    live = sub.receive_upto(published(llm))
    assert len(live) == published(llm) >= 4 and sub.topics == {b"plait-kv"}
    assert_consecutive(live)
    missed = sub.replay(replay, 2)
    assert missed == [b for b in live if b[0] >= 2]
    assert sub.replay(replay, len(live) + 5) == []
    llm.engine.close()


def test_topic_filters(tiny_path) -> None:
    other = Subscriber(topic=b"other")
    llm = events_llm(tiny_path, other, kv_events_topic="kv")
    llm.generate([prompt(40, 9)], SamplingParams(temperature=0, max_tokens=2))
    assert published(llm) >= 1
    llm.engine.close()  # sends what is queued, then closes the PUB socket
    other.wait_disconnected()  # so whatever it sent has arrived
    assert other.receive() == []
    other.close()


# ---------------------------------------------------------------- encoding, as vLLM's
# Written after vLLM's vllm/distributed/kv_events.py (after PR #42892: events are tagged
# maps, tag field "type"; the batch stays array-like). Field order and defaults as there.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The array form of vLLM up to 0.23 (array_like=True on the events too).
class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                        tag=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


def _log() -> list[list[Any]]:
    log = KVEventLog()
    a, b, c = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    log.stored(a, None, [1, 2])
    log.stored(b, a, [3, 4])  # continues the chain: same event
    log.stored(c, None, [5, 6])  # another chain: a new event
    log.removed(a)
    log.removed(b)
    return log.take()


@pytest.fixture
def publisher():
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", block_size=2)
    yield pub
    pub.shutdown()


def test_map_encoding_decodes_as_vllm_structs(publisher) -> None:
    payload = publisher.encode(12.5, _log())
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    h = [int.from_bytes(bytes([i]) * 8, "big") for i in (1, 2, 3)]
    assert batch.events == [
        BlockStored([h[0], h[1]], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0,
                    "full_attention"),
        BlockStored([h[2]], None, [5, 6], 2, None, "GPU", None, None, 0, "full_attention"),
        BlockRemoved([h[0], h[1]], "GPU", 0),
    ]
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "group_idx",
                               "kv_cache_spec_kind"]
    assert list(raw[1][2]) == ["type", "block_hashes", "medium", "group_idx"]


def test_array_encoding_decodes_as_older_vllm_structs() -> None:
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", block_size=2, encoding="array")
    try:
        log = [*_log(), ["C"]]
        payload = pub.encode(1.0, log)
        batch = msgspec.msgpack.Decoder(ArrayKVEventBatch).decode(payload)
        h0 = int.from_bytes(b"\x01" * 8, "big")
        assert batch.events[0] == ArrayBlockStored(
            [h0, int.from_bytes(b"\x02" * 8, "big")], None, [1, 2, 3, 4], 2, None, "GPU")
        raw = msgspec.msgpack.decode(payload)
        # every field in vLLM's order (msgspec writes array-like defaults too; decoders of
        # fewer fields ignore the trailing ones, as the decode above shows)
        assert raw[1][0] == ["BlockStored", batch.events[0].block_hashes, None, [1, 2, 3, 4],
                             2, None, "GPU", None, None, None, None, None]
        assert raw[1][2][0] == "BlockRemoved" and raw[1][3] == ["AllBlocksCleared"]
    finally:
        pub.shutdown()


def test_external_hash_is_vllms_int_form() -> None:
    digest = bytes(range(16))
    # vLLM's maybe_convert_block_hash: int.from_bytes(h, "big") & (2**64 - 1)
    assert external_hash(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)


def test_clear_drops_the_batch_before_it() -> None:
    log = KVEventLog()
    log.stored(b"a" * 16, None, [1])
    log.cleared()
    log.stored(b"b" * 16, None, [2])
    assert [e[0] for e in log.take()] == ["C", "S"]


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="kv_events_encoding"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_encoding="json")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    assert EngineConfig().kv_events_topic == "" and EngineConfig().kv_events_endpoint is None


def test_busy_port_fails_at_start() -> None:
    port = free_port()
    first = KVEventPublisher(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match="cannot open the KV events socket"):
            KVEventPublisher(f"tcp://*:{port}")
    finally:
        first.shutdown()


def test_cli_options() -> None:
    from plait.cli import build_parser, engine_config

    args = build_parser({}).parse_args(
        ["serve", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv",
         "--kv-events-replay-endpoint", "tcp://*:5558", "--kv-events-encoding", "array"])
    config = engine_config(args)
    assert (config.kv_events_endpoint, config.kv_events_topic,
            config.kv_events_replay_endpoint, config.kv_events_encoding) == (
        "tcp://*:5557", "kv", "tcp://*:5558", "array")
    config = engine_config(build_parser({"PLAIT_KV_EVENTS_ENDPOINT": "tcp://*:1"})
                           .parse_args(["serve"]))
    assert config.kv_events_endpoint == "tcp://*:1" and config.kv_events_topic == ""


# ---------------------------------------------------------------- held until subscribed
def _one_batch(i: int) -> list[list[Any]]:
    return [["S", [bytes([i]) * 16], None, [i, i]]]


def test_batches_wait_for_a_late_subscription_in_connect_mode() -> None:
    """A router that binds and has not yet run its socket (so its subscription has not
    reached the publisher) still gets every batch, in order, from the first: the XPUB
    holds them until a subscription matching the topic arrives. A plain PUB drops them."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # as llm-d's router subscribes
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv@pod@model", block_size=2)
    try:
        for i in range(5):
            pub.publish(_one_batch(i))
        # Nothing has touched `sub` since the publisher connected: no subscription yet.
        got = []
        while len(got) < 5:
            assert sub.poll(30_000), f"only {len(got)} batches arrived"
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"),
                        msgspec.msgpack.decode(payload)[1][0]["token_ids"]))
        assert got == [(b"kv@pod@model", i, [i, i]) for i in range(5)]
        pub.publish(_one_batch(5))  # subscribed now: sent at once
        assert sub.poll(30_000)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == 5
        assert pub.dropped == 0
    finally:
        pub.shutdown()
        sub.close(linger=0)
        ctx.term()


def test_held_batches_beyond_the_buffer_are_dropped_and_counted() -> None:
    """With no subscriber at all, at most `buffer_steps` batches are held: the oldest go
    first, each counted in `dropped`; the replay buffer still has the newest."""
    pub = KVEventPublisher(f"tcp://*:{free_port()}", block_size=2, buffer_steps=3)
    for i in range(7):
        pub.publish(_one_batch(i))
    pub.shutdown()  # the thread has taken every batch
    assert pub.dropped == 4
    assert [seq for seq, _ in pub._held] == [4, 5, 6]
    assert [seq for seq, _ in pub._buffer] == [4, 5, 6]


def test_a_subscription_to_another_topic_does_not_release_held_batches() -> None:
    import zmq

    ctx = zmq.Context()
    other = ctx.socket(zmq.SUB)
    port = free_port()
    other.bind(f"tcp://127.0.0.1:{port}")
    other.setsockopt(zmq.SUBSCRIBE, b"other")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", block_size=2)
    try:
        pub.publish(_one_batch(1))
        assert not other.poll(1000)  # its subscription arrived meanwhile, and matches nothing
        pub.shutdown()
        assert [seq for seq, _ in pub._held] == [0]
    finally:
        other.close(linger=0)
        ctx.term()
