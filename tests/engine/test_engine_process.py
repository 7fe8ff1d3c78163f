"""The engine core in its own process: the wire format, `ProcessEngine` driven directly, and
`plait serve` (a tiny random-weight model) with its `plait-engine` child: requests end to
end, the child's death, SIGTERM drain, and the child dying with the server."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.requests import completion_body
from helpers.server import RemoteServer, parse_sse, start_server, wait_for

from plait.engine import wire
from plait.engine.client import EngineLoadError
from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import EngineStats
from plait.engine.engine_process import PROCESS_NAME, ProcessEngine, _idle_release, _receive
from plait.engine.host_memory import IdleHeapRelease
from plait.engine.outputs import RequestDelta, TokenLogprob
from plait.engine.sampling_params import SamplingParams

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds the engine process through /proc")
MODEL = "tiny"


# ---------------------------------------------------------------- (a) the wire format
def test_every_boundary_type_round_trips() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={3: -1.5, 7: 2.0}, seed=None,
                            max_tokens=None, stop=["\n\n", "END"], stop_token_ids=[2],
                            logprobs=3, prompt_logprobs=None)
    commands = [wire.AddCommand("r-0", [1, 2, 3], params), wire.AbortCommand("r-1"),
                wire.AddBatchCommand([wire.AddCommand("r-2", [4], params),
                                      wire.AddCommand("r-3", [4], params.for_choice(1))]),
                wire.ShutdownCommand()]
    for command in commands:
        assert wire.decode_command(wire.encode(command)) == command
    full = RequestDelta(
        "r-0", [5, 6], "ab", logprobs=[TokenLogprob(5, -0.25, [(5, -0.25), (9, -2.0)])],
        finish_reason="stop", stop_reason=6, error=None, num_prompt_tokens=3,
        num_cached_tokens=2, prompt_logprobs=[None, TokenLogprob(2, -3.5), None])
    events = [
        wire.ReadyEvent(RuntimeInfo("cpu", "float32", 64, 128, 100, (0, 2), "m"), 42,
                        EngineStats(kv_blocks_total=64)),
        wire.OutputsEvent([full, RequestDelta("r-1", stop_reason="\n\n"),
                           RequestDelta("r-2", finish_reason="error", error="boom")],
                          EngineStats(num_running=1, kv_blocks_used=32, kv_blocks_total=64,
                                      last_error="RuntimeError: x")),
        wire.OutputsEvent([], EngineStats()),
        wire.FatalEvent("engine loop died: EngineKilled"),
        wire.FatalEvent("ModelLoadError: no such model", loading=True),
    ]
    for event in events:
        assert wire.decode_event(wire.encode(event)) == event
    decoded = wire.decode_event(wire.encode(events[1]))
    assert isinstance(decoded.deltas[0].logprobs[0], TokenLogprob)
    assert decoded.deltas[0].logprobs[0].top == [(5, -0.25), (9, -2.0)]
    assert isinstance(decoded.stats, EngineStats) and decoded.stats.kv_cache_usage == 0.5
    start = wire.EngineStart(EngineConfig(model="/m", num_kv_blocks=8), True, 10, 1)
    assert wire.decode_start(wire.encode(start)) == start


def test_malformed_frames_are_rejected_cleanly() -> None:
    good = wire.encode(wire.AddCommand("r", [1], SamplingParams()))
    bad_frames = [b"", b"\xc1", good[:-1], b"\x93\xa3add\x01\x02",  # truncated, wrong types
                  wire.encode(["nope", "r"]),  # unknown tag
                  wire.encode(wire.FatalEvent("x"))]  # an event where a command belongs
    for frame in bad_frames:
        with pytest.raises(wire.WireError, match="malformed frame"):
            wire.decode_command(frame)
    with pytest.raises(wire.WireError):  # a command where an event belongs
        wire.decode_event(good)
    with pytest.raises(wire.WireError, match="num_running"):  # stats are typed too
        wire.decode_event(wire.encode(["outputs", [], {"num_running": "1"}]))
    out_of_range = wire.encode(["add", "r", [1], {"temperature": 9.0}])
    with pytest.raises(wire.WireError, match="temperature"):  # the dataclass's own checks
        wire.decode_command(out_of_range)


# ---------------------------------------------------------------- ProcessEngine directly
def test_a_blocking_receive_is_the_idle_period_of_the_heap_release() -> None:
    """The child's `_receive` marks the pipe wait of an idle loop (block=True) as idle for
    `IdleHeapRelease` and the command's arrival as work; a polling receive (block=False, the
    loop still busy) marks nothing. So a wait longer than `after_s` after work releases once;
    the release runs while the loop waits, not in a step."""
    calls: list[float] = []
    release = IdleHeapRelease(0.2, release=lambda: calls.append(time.monotonic()) or True)
    parent, child = multiprocessing.Pipe()
    try:
        assert _receive(child, False, release) is None  # busy loop polling: not idle
        time.sleep(0.4)
        assert calls == []
        parent.send_bytes(wire.encode(wire.AbortCommand("r-0")))
        assert _receive(child, True, release) == wire.AbortCommand("r-0")  # work
        timer = threading.Timer(0.8, lambda: parent.send_bytes(
            wire.encode(wire.AbortCommand("r-1"))))
        timer.start()
        assert _receive(child, True, release) == wire.AbortCommand("r-1")  # 0.8 s idle
        timer.join()
        assert len(calls) == 1
    finally:
        release.close()
        parent.close()
        child.close()


def test_the_heap_release_is_for_cpu_engines_with_a_delay() -> None:
    cpu = RuntimeInfo("cpu", "float32", 64, 128, 100, (0, 2), "m")
    release = _idle_release(EngineConfig(idle_memory_release_s=2.5), cpu)
    assert release is not None and release.after_s == 2.5
    release.close()
    assert _idle_release(EngineConfig(idle_memory_release_s=0), cpu) is None
    cuda = RuntimeInfo("cuda:0", "float32", 64, 128, 100, (0, 2), "m")
    assert _idle_release(EngineConfig(), cuda) is None
    with pytest.raises(ValueError, match="idle_memory_release_s"):
        EngineConfig(idle_memory_release_s=-1)


def test_the_api_process_trims_its_heap_once_the_tokenizer_is_loaded(monkeypatch) -> None:
    """`ProcessEngine.load` gives the C heap's free pages back once it has loaded the
    tokenizer (whose JSON parse leaves 44 MB free mid-heap for Qwen2.5's vocabulary) and
    encoded the start frame, and before it spawns the engine child."""
    from plait.engine import engine_process

    calls: list[str] = []

    class Stop(Exception):
        pass

    def release() -> bool:
        calls.append("release")
        raise Stop  # the child is not spawned

    monkeypatch.setattr(engine_process, "resolve_model",
                        lambda *args, **kwargs: type("R", (), {"path": Path("model")})())
    monkeypatch.setattr(engine_process, "load_tokenizer",
                        lambda path: calls.append(f"tokenizer {path}"))
    monkeypatch.setattr(engine_process, "release_free_heap", release)
    engine = ProcessEngine(EngineConfig(model="model"))
    with pytest.raises(Stop):
        engine.load()
    assert calls == ["tokenizer model", "release"]
    assert engine._reader is None


def test_load_sends_the_engine_the_tokenizers_vocabulary(tiny_path: Path, monkeypatch) -> None:
    """The engine child's start frame carries the tokenizer's `Vocabulary`, so the child
    decodes without loading the tokenizer (engine/vocabulary.py)."""
    from plait.engine.vocabulary import Vocabulary

    frames: list[bytes] = []

    def capture(self: ProcessEngine, child_conn, start: bytes) -> None:
        frames.append(start)
        child_conn.close()
        self._load_error = "captured"  # no child is spawned
        self._loaded.set()

    monkeypatch.setattr(ProcessEngine, "_read", capture)
    engine = ProcessEngine(EngineConfig(model=str(tiny_path), num_kv_blocks=64))
    with pytest.raises(EngineLoadError, match="captured"):
        engine.load()
    start = wire.decode_start(frames[0])
    assert start.config == engine.config and start.parent_pid == os.getpid()
    assert start.vocabulary is not None
    assert start.vocabulary == Vocabulary.from_tokenizer(engine.tokenizer)


def test_process_engine_serves_and_reports_fresh_stats(tiny_path: Path) -> None:
    engine = ProcessEngine(EngineConfig(model=str(tiny_path), num_kv_blocks=64))

    async def scenario() -> None:
        engine.start(asyncio.get_running_loop())
        assert engine.healthy and engine.pid not in (None, os.getpid())
        before = engine.stats().generation_tokens
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        streams = [engine.add_request(f"r-{i}", [1, 2, 3], params) for i in range(2)]
        assert engine.num_queued == 2
        finals = []
        for stream in streams:
            deltas = [delta async for delta in stream]
            assert sum(len(d.token_ids) for d in deltas) == 4
            finals.append(deltas[-1].finish_reason)
        assert finals == ["length", "length"] and engine.num_queued == 0
        # The snapshot travelled with the final deltas: already up to date.
        assert engine.stats().generation_tokens - before == 8
        long = engine.add_request("r-long", [1, 2, 3], SamplingParams(max_tokens=None,
                                                                      ignore_eos=True))
        first = await anext(long)
        assert first.finish_reason is None
        engine.abort("r-long")
        last = [delta async for delta in long][-1]
        assert last.finish_reason == "abort"

    engine.load()
    try:
        asyncio.run(scenario())
        pid = engine.pid
    finally:
        engine.shutdown(30)
    assert not engine.healthy and engine.dead_error == "the engine was shut down"
    assert not Path(f"/proc/{pid}").exists() or not sys.platform.startswith("linux")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_load_that_fails_in_the_child_is_one_line(tiny_path: Path) -> None:
    engine = ProcessEngine(EngineConfig(model=str(tiny_path), device="cuda"))
    with pytest.raises(EngineLoadError) as failure:
        engine.load()
    message = str(failure.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.split(":")[0].isidentifier()  # "Type: message", like an in-process load
    engine.shutdown(10)
    assert not engine.ready


# ---------------------------------------------------------------- plait serve
def engine_pids(server_pid: int) -> list[int]:
    """Pids of the `plait-engine` children of `server_pid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        state, ppid = text[text.rindex(")") + 2:].split()[:2]
        if comm == PROCESS_NAME and int(ppid) == server_pid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, not yet reaped by its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:].split()[0] == "Z"


def serve_tiny(tiny_path: Path, *args: str) -> RemoteServer:
    server = start_server([str(tiny_path), "--served-model-name", MODEL, "--num-kv-blocks",
                           "256", "--drain-timeout", "30", *args])
    server.wait_healthy()
    return server


@pytest.fixture
def tiny_server(tiny_path: Path):
    server = serve_tiny(tiny_path)
    yield server
    server.stop()


def _body(n: int = 1, stream: bool = False, max_tokens: int = 8) -> dict:
    return completion_body("Once upon a time", model=MODEL, n=n, max_tokens=max_tokens,
                           temperature=1.0, seed=7, ignore_eos=True, stream=stream)


@linux_only
def test_serve_runs_the_engine_in_a_child_and_n3_works_both_ways(tiny_server) -> None:
    server = tiny_server
    [engine_pid] = engine_pids(server.process.pid)
    with server.http() as http:
        generated = server.metrics()["plait_generation_tokens_total"]
        whole = http.post("/v1/completions", json=_body(n=3)).json()
        texts = [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
        assert len(texts) == 3 and all(texts)
        assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * 3
        assert whole["usage"]["completion_tokens"] == 24
        assert server.metrics()["plait_generation_tokens_total"] - generated == 24
        sse = parse_sse(http.post("/v1/completions", json=_body(n=3, stream=True)).content)
    assert sse.events[-1] == "[DONE]"
    streamed = ["", "", ""]
    for chunk in sse.chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts  # same seeds, same engine: the same three choices
    assert engine_pids(server.process.pid) == [engine_pid]


@linux_only
def test_a_stop_string_ends_the_request_in_the_engine_without_an_extra_token(
        tiny_server) -> None:
    """Stop strings are matched in the engine process: the request ends on the token that
    completes the match, and no token beyond it is computed."""
    server = tiny_server
    with server.http() as http:
        first = http.post("/v1/completions", json={**_body(max_tokens=12), "logprobs": 0})
        choice = first.json()["choices"][0]
        tokens, text = choice["logprobs"]["tokens"], choice["text"]
        assert "".join(tokens) == text
        k = next(i for i in range(1, len(tokens)) if tokens[i].strip().isalnum()
                 and text.find(tokens[i]) == len("".join(tokens[:i])))
        generated = server.metrics()["plait_generation_tokens_total"]
        stopped = http.post("/v1/completions", json={**_body(max_tokens=12),
                                                      "stop": [tokens[k]]}).json()
    assert stopped["choices"][0]["text"] == "".join(tokens[:k])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == k + 1
    assert server.metrics()["plait_generation_tokens_total"] - generated == k + 1


@linux_only
def test_killing_the_engine_process_fails_streams_and_health(tiny_server) -> None:
    server = tiny_server
    [engine_pid] = engine_pids(server.process.pid)
    with server.http() as http:
        with http.stream("POST", "/v1/completions",
                         json=_body(stream=True, max_tokens=1500)) as victim:
            lines = victim.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(engine_pid, signal.SIGKILL)
            assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 30)
            rest = "\n\n".join(line for line in lines if line) + "\n\n"
        events = parse_sse(rest.encode()).events
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "the engine process died (killed by SIGKILL)"
        refused = http.post("/v1/completions", json=_body())
        assert refused.status_code == 503 and "stopped" in refused.json()["error"]["message"]
    assert server.process.poll() is None  # the server lives on, answering 503s
    assert "the engine process died (killed by SIGKILL)" in server.log()


@linux_only
def test_sigterm_drains_a_stream_then_server_and_engine_exit(tiny_server) -> None:
    server = tiny_server
    [engine_pid] = engine_pids(server.process.pid)
    with server.http() as http, http.stream(
            "POST", "/v1/completions", json=_body(stream=True, max_tokens=100)) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        server.process.send_signal(signal.SIGTERM)  # the listening socket closes at once
        rest = "\n\n".join(line for line in [first, *lines] if line) + "\n\n"
    events = parse_sse(rest.encode()).events
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1])
    assert server.process.wait(60) == 0
    assert not Path(f"/proc/{engine_pid}").exists()  # joined: not even a zombie


@linux_only
def test_sigterm_to_both_processes_still_drains(tiny_path: Path) -> None:
    """`kill -TERM -<pgid>` (systemd, a shell's job control) reaches the engine process too:
    it ignores SIGTERM and keeps stepping until the draining server tells it to stop."""
    server = serve_tiny(tiny_path)
    try:
        [engine_pid] = engine_pids(server.process.pid)
        with server.http() as http, http.stream(
                "POST", "/v1/completions", json=_body(stream=True, max_tokens=100)) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            os.kill(engine_pid, signal.SIGTERM)
            server.process.send_signal(signal.SIGTERM)
            rest = "\n\n".join(line for line in [first, *lines] if line) + "\n\n"
        events = parse_sse(rest.encode()).events
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(60) == 0
        assert wait_for(lambda: _gone(engine_pid), 10)
    finally:
        server.stop()


@linux_only
def test_the_engine_process_dies_with_a_killed_server(tiny_path: Path) -> None:
    server = serve_tiny(tiny_path)
    try:
        [engine_pid] = engine_pids(server.process.pid)
        server.process.kill()
        server.process.wait(10)
        assert wait_for(lambda: _gone(engine_pid), 10)
    finally:
        server.stop()


@linux_only
def test_no_engine_process_serves_from_a_thread(tiny_path: Path) -> None:
    server = serve_tiny(tiny_path, "--no-engine-process")
    try:
        assert engine_pids(server.process.pid) == []
        with server.http() as http:
            choices = http.post("/v1/completions", json=_body(n=3)).json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["length"] * 3
    finally:
        server.stop()
