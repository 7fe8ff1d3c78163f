"""What crosses the boundary between the server process and the engine process, and how it
is framed: msgpack through msgspec, never pickle.

    server process                               engine process
    AddCommand / AddBatchCommand / AbortCommand / ShutdownCommand  -->
                                            <--  ReadyEvent(RuntimeInfo, stats) once loaded
                                            <--  OutputsEvent(deltas, EngineStats) after each step
                                            <--  FatalEvent(error): loading failed or the loop died

One message is one frame (`Connection.send_bytes` keeps frame boundaries). Each message is a
tagged msgspec Struct; the payload types (`SamplingParams`, `RequestDelta`, `TokenLogprob`,
`EngineStats`, `RuntimeInfo`, `EngineConfig`) are the engine's own dataclasses, which
msgspec encodes and decodes field by field with type checks (and runs their
`__post_init__` validation).

Why msgspec: it encodes and decodes these dataclasses directly (no hand-written to/from
dict), checks types while decoding so a malformed or foreign frame raises `WireError`
instead of building half-valid objects, is several times faster than json/pickle on token
id lists, and, unlike pickle, a frame can never execute code in the receiver.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import EngineStats
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.engine.vocabulary import Vocabulary


class WireError(ValueError):
    """A frame that is not a valid message of the expected direction."""


# ---------------------------------------------------------------- server -> engine
class EngineStart(msgspec.Struct, frozen=True):
    """The engine process's start arguments (the only thing its spawn carries besides the
    pipe). `fault_injection` arms the test-only engine faults (engine/faults.py);
    `log_level` is the server's logging level, so both processes log alike; `parent_pid`
    lets the child notice a parent that died before it could ask to die with it;
    `vocabulary` is the tokenizer's text view (vocabulary.py), so the child need not load
    the tokenizer (None: it loads it)."""

    config: EngineConfig
    fault_injection: bool = False
    log_level: int = 20
    parent_pid: int | None = None
    vocabulary: Vocabulary | None = None


class AddCommand(msgspec.Struct, tag="add", array_like=True):
    """Queue one sub-request (`EngineCore.add_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AddBatchCommand(msgspec.Struct, tag="add_batch", array_like=True):
    """Queue several sub-requests at once (one HTTP request's fan-out): the engine applies
    all of them before its next step, so the n choices of a prompt start in the same step
    (a choice arriving a step late would compute scored prompt logprobs again)."""

    requests: list[AddCommand]


class AbortCommand(msgspec.Struct, tag="abort", array_like=True):
    """Stop one sub-request (`EngineCore.abort`); unknown or finished ids are ignored."""

    request_id: str


class ShutdownCommand(msgspec.Struct, tag="shutdown", array_like=True):
    """Leave the loop and exit; requests still live are dropped (the server drained first)."""


Command = AddCommand | AddBatchCommand | AbortCommand | ShutdownCommand


# ---------------------------------------------------------------- engine -> server
class ReadyEvent(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded; sent once, first. `stats` is the core's first snapshot."""

    info: RuntimeInfo
    pid: int
    stats: EngineStats


class OutputsEvent(msgspec.Struct, tag="outputs", array_like=True):
    """The deltas of one loop iteration (possibly none) and the core's stats after it.

    Stats travel with the deltas, so a reader that sees a request's final delta also sees
    the counters that include it."""

    deltas: list[RequestDelta]
    stats: EngineStats


class FatalEvent(msgspec.Struct, tag="fatal", array_like=True):
    """The engine process is about to exit on an error: one line, no traceback. `loading`
    tells a failed model load (the CLI reports "cannot load the model") from a loop that
    died while serving."""

    error: str
    loading: bool = False


Event = ReadyEvent | OutputsEvent | FatalEvent

T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_event_decoder = msgspec.msgpack.Decoder(Event)
_start_decoder = msgspec.msgpack.Decoder(EngineStart)


def encode(message: Command | Event | EngineStart) -> bytes:
    """One frame for a command, an event or `EngineStart`."""
    return _encoder.encode(message)


def decode_command(frame: bytes) -> Command:
    """The command in `frame`; raises `WireError` if it is not one."""
    return _decode(_command_decoder, frame)


def decode_event(frame: bytes) -> Event:
    """The event in `frame`; raises `WireError` if it is not one."""
    return _decode(_event_decoder, frame)


def decode_start(frame: bytes) -> EngineStart:
    """The start arguments in `frame`; raises `WireError` if they are malformed."""
    return _decode(_start_decoder, frame)


def _decode(decoder: msgspec.msgpack.Decoder[T], frame: bytes) -> T:
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        # ValueError/TypeError: a dataclass's own __post_init__ refused the values.
        raise WireError(f"malformed frame ({len(frame)} bytes): {exc}") from None
