"""The engine core in its own process (what `plait serve` runs by default): the server keeps
the tokenizer (prompt encoding, chat templates, /tokenize), the HTTP stack and the streams;
a child process named `plait-engine` owns the model, the KV cache, the scheduler, and
detokenization with stop strings. Those stay with the core on purpose: a matched stop string
ends the request and frees its KV blocks in the same step, with no extra token computed, and
deltas cross the pipe already as text. The child decodes through the tokenizer's
`Vocabulary` (vocabulary.py), which the server builds from its tokenizer and sends with the
start arguments: it loads the tokenizer itself (about 130 MB for a 152k vocabulary) only
when a grammar or a draft model's vocabulary check asks for it.

    server process (ProcessEngine)                engine process (run_engine_process)
    event loop: add_request / abort
       -> outbox queue -> writer thread  ==pipe==>  run_core_loop: drain commands,
    event loop <- call_soon_threadsafe <- reader     core.step(), send OutputsEvent
                  thread (spawned the child)  <==pipe==

Transport: a `multiprocessing` spawn-context duplex `Pipe` (a Unix socket pair) with
`send_bytes` / `recv_bytes`; every frame is a msgspec-encoded message of engine/wire.py, so
no boundary type is pickled (spawn itself pickles only the pipe handle and the entry point;
the start arguments go as one msgspec frame). pyzmq would add a dependency and a context
for what is one peer, in order, on one machine; the pipe's EOF is also exactly the "other
side died" signal both processes need.

Neither side ever blocks the event loop: the writer thread encodes and sends (a 10 MB
prompt waits there while the child is mid-step), the reader thread decodes. The child
blocks on the pipe only while it has nothing to step, ignores SIGINT and SIGTERM (a
terminal's Ctrl-C or a process-group SIGTERM reaches it too; the server drains first, then
sends `ShutdownCommand`),
dies with the server (PR_SET_PDEATHSIG on Linux, and EOF of the pipe), and reports a failed
load or a dead loop as one `FatalEvent` line before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from plait.engine.client import EngineClient, EngineLoadError, run_core_loop
from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import EngineStats
from plait.engine.libc import release_free_heap
from plait.engine.model_loader import load_tokenizer, resolve_model
from plait.engine.outputs import RequestDelta
from plait.engine.vocabulary import Vocabulary
from plait.engine.wire import (
    Command,
    EngineStart,
    Event,
    FatalEvent,
    OutputsEvent,
    ReadyEvent,
    ShutdownCommand,
    WireError,
    decode_command,
    decode_event,
    decode_start,
    encode,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from plait.engine.host_memory import IdleHeapRelease

logger = logging.getLogger("plait.engine")

PROCESS_NAME = "plait-engine"  # the child's name in `ps -o comm` (Linux)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as `plait serve` logs
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class ProcessEngine(EngineClient):
    """`EngineClient` whose core runs in a child process (see the module docstring).

    `load()` resolves the model here first (a GGUF is converted once, never by two
    processes at the same time, in a short-lived spawned process: this one never imports
    torch), loads the tokenizer, spawns the child and waits for its
    `ReadyEvent`; a load that fails in the child raises `EngineLoadError` with its one line.
    `fault_injection` arms the engine-side test faults in the child (engine/faults.py).
    `pid` is the engine process's pid once it is ready. `core` stays None.
    """

    def __init__(self, config: EngineConfig, fault_injection: bool = False) -> None:
        super().__init__(config)
        self.pid: int | None = None
        self._fault_injection = fault_injection
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._info: RuntimeInfo | None = None
        self._conn: Connection | None = None
        self._process: BaseProcess | None = None  # set by the reader thread
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._loaded = threading.Event()
        self._load_error: str | None = None
        self._stopping = False

    # ---------------------------------------------------------------- lifecycle
    def load(self) -> None:
        resolved = resolve_model(self.config.model, self.config.weights == "float32",
                                 isolate_conversion=True)  # this process stays torch-free
        self._tokenizer = load_tokenizer(resolved.path)
        # The vocabulary lives only in the frame: encoded here, then its pieces and the
        # tokenizer file's parse, both freed mid-heap, are given back at once (libc.py).
        start = encode(EngineStart(self.config, self._fault_injection,
                                   logging.getLogger("plait").getEffectiveLevel(), os.getpid(),
                                   Vocabulary.from_tokenizer(self._tokenizer)))
        release_free_heap()
        self._conn, child_conn = multiprocessing.get_context("spawn").Pipe(duplex=True)
        # The reader thread spawns the child: PR_SET_PDEATHSIG fires when the *thread* that
        # forked exits, and the reader lives exactly as long as the child.
        self._reader = threading.Thread(target=self._read, args=(child_conn, start),
                                        name="plait-engine-reader", daemon=True)
        self._reader.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise EngineLoadError(self._load_error)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver deltas on `loop` from now on."""
        if self._info is None:
            raise RuntimeError("load() the engine before start()")
        self._loop = loop

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the child to exit and join it; kill it if it is not gone within `timeout`."""
        self._stopping = True
        self._outbox.put(ShutdownCommand())
        self._outbox.put(None)  # then the writer thread ends
        if self._reader is None:
            return
        self._reader.join(timeout)
        if self._reader.is_alive():
            logger.warning("the engine process did not exit within %.0f s: killing it", timeout)
            with contextlib.suppress(Exception):
                if self._process is not None:
                    self._process.kill()
            self._reader.join(5)

    @property
    def ready(self) -> bool:
        return self._info is not None and self._loop is not None

    @property
    def healthy(self) -> bool:
        return self.ready and self.dead_error is None

    @property
    def info(self) -> RuntimeInfo:
        assert self._info is not None, "load the engine first"
        return self._info

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        assert self._tokenizer is not None, "load the engine first"
        return self._tokenizer

    # ---------------------------------------------------------------- threads
    def _send(self, command: Command) -> None:
        self._outbox.put(command)

    def _write(self, conn: Connection) -> None:
        """Writer thread: encode and send commands in order until the `None` sentinel."""
        while (command := self._outbox.get()) is not None:
            try:
                conn.send_bytes(encode(command))
            except OSError:  # the child is gone: the reader reports it
                return

    def _read(self, child_conn: Connection, start: bytes) -> None:
        """Reader thread: spawn the child with its `EngineStart` frame, then hand its
        events over until EOF."""
        assert self._conn is not None
        try:
            process = multiprocessing.get_context("spawn").Process(
                target=run_engine_process, args=(child_conn, start),
                name=PROCESS_NAME, daemon=True)
            self._process = process
            process.start()
        except Exception as exc:  # e.g. out of memory or file descriptors
            self._load_error = f"{type(exc).__name__}: {exc}"
            self._loaded.set()
            return
        finally:
            child_conn.close()  # else the child's death would never read as EOF here
        threading.Thread(target=self._write, args=(self._conn,), name="plait-engine-writer",
                         daemon=True).start()
        try:
            while True:
                self._handle(decode_event(self._conn.recv_bytes()))
        except (EOFError, OSError):
            pass  # the child exited or died
        except WireError as exc:  # a bug: the two sides disagree on the wire format
            logger.error("bad frame from the engine process: %s", exc)
            process.kill()
        process.join(5)
        self._on_exit(_describe_exit(process.exitcode))

    def _handle(self, event: Event) -> None:
        if isinstance(event, OutputsEvent):
            self._deliver(event.deltas, event.stats)
        elif isinstance(event, ReadyEvent):
            self._info, self.pid, self._stats = event.info, event.pid, event.stats
            self._loaded.set()
        elif event.loading:
            self._load_error = event.error
            self._loaded.set()
        else:
            logger.error("the engine process failed: %s", event.error)
            self._die(event.error)

    def _on_exit(self, how: str) -> None:
        if not self._loaded.is_set():
            self._load_error = f"the engine process exited while loading the model ({how})"
            self._loaded.set()
        elif self._stopping:
            self._die("the engine was shut down")
        elif self.dead_error is None:
            logger.error("the engine process died (%s)", how)
            self._die(f"the engine process died ({how})")
        if self._conn is not None:
            self._conn.close()


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


# ---------------------------------------------------------------- the engine process
def run_engine_process(conn: Connection, start_frame: bytes) -> None:
    """Entry point of the engine process: load the core, send `ReadyEvent`, serve commands
    until `ShutdownCommand` or EOF of the pipe. A failed load or a dead loop is reported
    as one `FatalEvent` line before the process exits (non-zero for a dead loop)."""
    # A terminal's Ctrl-C (SIGINT) and `kill -TERM -<pgid>` (SIGTERM) reach the whole process
    # group; the server drains first and then sends ShutdownCommand, so both are ignored here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start = decode_start(start_frame)
    _die_with_parent(start.parent_pid)
    logging.basicConfig(level=start.log_level, format=LOG_FORMAT)
    try:
        from plait.engine.core import EngineCore  # torch: imported here, after the checks

        core = EngineCore(start.config, vocabulary=start.vocabulary)
        if start.fault_injection:
            from plait.engine.faults import arm_engine_faults

            arm_engine_faults(core)
    except Exception as exc:  # one line, no traceback: usually a bad model path
        _send_quietly(conn, FatalEvent(f"{type(exc).__name__}: {exc}", loading=True))
        return
    release = _idle_release(start.config, core.info)
    try:
        conn.send_bytes(encode(ReadyEvent(core.info, os.getpid(), core.stats())))
        run_core_loop(core, lambda block: _receive(conn, block, release),
                      lambda deltas, stats: _emit(conn, deltas, stats))
    except (BrokenPipeError, ConnectionResetError):
        return  # the server is gone; nobody to tell
    except BaseException as exc:  # the loop died: tell the server, then exit non-zero
        logger.exception("engine loop died")
        _send_quietly(conn, FatalEvent(f"engine loop died: {type(exc).__name__}"))
        sys.exit(1)
    finally:
        core.close()  # flush the KV events still queued, close their sockets
        if release is not None:
            release.close()


def _idle_release(config: EngineConfig, info: RuntimeInfo) -> IdleHeapRelease | None:
    """The heap release of a CPU engine (`idle_memory_release_s`), or None (0, or CUDA)."""
    if not config.idle_memory_release_s or info.device != "cpu":
        return None
    from plait.engine.host_memory import IdleHeapRelease

    return IdleHeapRelease(config.idle_memory_release_s)


def _receive(conn: Connection, block: bool,
             release: IdleHeapRelease | None = None) -> Command | None:
    if not block and not conn.poll():
        return None
    if block and release is not None:
        release.waiting()
    try:
        return decode_command(conn.recv_bytes())
    except EOFError:  # the server closed its end (or died): stop
        return ShutdownCommand()
    finally:
        if block and release is not None:
            release.working()


def _emit(conn: Connection, deltas: list[RequestDelta], stats: EngineStats) -> None:
    conn.send_bytes(encode(OutputsEvent(deltas, stats)))


def _send_quietly(conn: Connection, event: Event) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(encode(event))


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when the server (its forking thread) goes, and
    name it `plait-engine`; exit at once if the server is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
            libc.prctl(_PR_SET_NAME, PROCESS_NAME.encode())
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
