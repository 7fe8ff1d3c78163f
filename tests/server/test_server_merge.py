"""StreamMerger over real engine RequestStreams: order, termination, bounded memory."""

from __future__ import annotations

import asyncio

from plait.engine.async_engine import RequestStream
from plait.engine.outputs import RequestDelta
from plait.server.merge import StreamMerger

LIVENESS_S = 30  # a broken merger fails after this long instead of hanging


def delta(request_id: str, text: str, finish: str | None = None) -> RequestDelta:
    return RequestDelta(request_id, [len(text)], text, finish_reason=finish)


async def collect(merger: StreamMerger) -> list[tuple[int, str, str | None]]:
    return [(key, d.text, d.finish_reason) async for key, d in merger]


async def test_interleaves_in_arrival_order_and_ends_when_all_finish() -> None:
    """Each delta is put only after the one before came out: the merger yields them in the
    order they arrived, whichever stream they are on, and ends after the last final."""
    streams = {i: RequestStream(f"r-{i}") for i in range(3)}
    merger = StreamMerger(streams)
    schedule = [(1, "a"), (0, "b"), (2, "c"), (1, "d"), (0, "e"), (2, "f"), (1, "g")]
    finals = {0: "e", 1: "g", 2: "f"}
    got = []
    for i, text in schedule:
        streams[i].put(delta(f"r-{i}", text, "stop" if finals[i] == text else None))
        key, d = await asyncio.wait_for(anext(merger), LIVENESS_S)
        got.append((key, d.text, d.finish_reason))
    assert await asyncio.wait_for(collect(merger), LIVENESS_S) == []
    assert [(i, text) for i, text, _ in got] == schedule
    assert [(i, f) for i, _, f in got if f] == [(0, "stop"), (2, "stop"), (1, "stop")]


async def test_same_turn_deltas_come_out_by_key_and_each_stream_stays_in_order() -> None:
    streams = {i: RequestStream(f"r-{i}") for i in range(4)}
    merger = StreamMerger(streams)
    for i in (3, 1, 2, 0):  # all ready before the first read
        streams[i].put(delta(f"r-{i}", f"x{i}"))
    first = [await anext(merger) for _ in range(4)]
    assert [key for key, _ in first] == [0, 1, 2, 3]
    for i in (2, 0, 3, 1):
        streams[i].put(delta(f"r-{i}", f"y{i}", "length"))
    rest = await asyncio.wait_for(collect(merger), LIVENESS_S)
    assert [(k, t) for k, t, _ in rest] == [(0, "y0"), (1, "y1"), (2, "y2"), (3, "y3")]


async def test_slow_reader_costs_one_coalesced_delta_per_stream() -> None:
    """Deltas produced while nobody reads are merged in the engine stream: the merger never
    queues them, so 1000 steps arrive as one delta per stream."""
    streams = {i: RequestStream(f"r-{i}") for i in range(2)}
    merger = StreamMerger(streams)
    for step in range(1000):
        for i in range(2):
            streams[i].put(delta(f"r-{i}", "t", "length" if step == 999 else None))
    got = await asyncio.wait_for(collect(merger), LIVENESS_S)
    assert [(k, len(t), f) for k, t, f in got] == [(0, 1000, "length"), (1, 1000, "length")]


async def test_wait_ready_times_out_then_close_cancels_waiters() -> None:
    stream = RequestStream("r-0")
    merger = StreamMerger({0: stream})
    assert await merger.wait_ready(0.05) is False
    waiters = list(merger._waiters.values())
    merger.close()
    await asyncio.sleep(0)
    assert all(task.cancelled() or task.done() for task in waiters)
    assert await asyncio.wait_for(collect(merger), LIVENESS_S) == []
    stream.put(delta("r-0", "late", "stop"))  # the stream itself is untouched
    late = await asyncio.wait_for(anext(stream), LIVENESS_S)
    assert (late.text, late.finish_reason, stream.finished) == ("late", "stop", True)
