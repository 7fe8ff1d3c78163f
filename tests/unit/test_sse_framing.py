"""SSE framing (server/sse.py): a token's text never breaks its event's `data:` line, for a
client that splits lines as Python does (httpx's `aiter_lines`, str.splitlines)."""

from __future__ import annotations

import json

from plait.server.responses.stream import EventLog
from plait.server.sse import encode

# every character str.splitlines ends a line at
LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _data_lines(frame: bytes) -> list[str]:
    """The frame's `data:` lines as str.splitlines cuts them (as httpx 0.28-0.29's line
    decoder does)."""
    return [line for line in frame.decode().splitlines() if line.startswith("data: ")]


def test_chat_chunk_with_every_line_end_stays_one_line() -> None:
    payload = {"choices": [{"index": 0, "delta": {"content": f"a{LINE_ENDS}b"}}]}
    frame = encode(payload)
    assert frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    (line,) = _data_lines(frame)
    assert json.loads(line.removeprefix("data: ")) == payload  # the same JSON value


def test_responses_event_with_every_line_end_stays_one_line() -> None:
    frame = EventLog().frame("response.output_text.delta", delta=f"x{LINE_ENDS}y")
    (line,) = _data_lines(frame)
    assert json.loads(line.removeprefix("data: "))["delta"] == f"x{LINE_ENDS}y"


def test_other_text_stays_raw_utf8() -> None:
    assert encode({"t": "é😀"}) == 'data: {"t":"é😀"}\n\n'.encode()
