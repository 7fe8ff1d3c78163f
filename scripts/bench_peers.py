#!/usr/bin/env python3
"""Side-by-side server benchmark: the same streamed workloads against each server in turn.

    python scripts/bench_peers.py \\
        --server plait-thread='.venv/bin/plait serve --no-engine-process --port {port}' \\
        --server plait-proc='.venv/bin/plait serve --port {port}' \\
        --server vllm='vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port {port}' \\
        --json bench/results/peers.json

Each `--server NAME=COMMAND` is started on 127.0.0.1 (`{port}` becomes a free port; the
command runs without a shell, in its own process group), waited for (`/health` 200, or
`/v1/models` 200 where there is no /health), warmed up with one 1-token request, measured,
then stopped (SIGTERM to its group, SIGKILL after 30 s). A server that fails to start is
reported and skipped. The model is the first one `/v1/models` lists.

Workloads (`--workloads`, sizes scale with `--tokens` T and `--prompt-tokens` P):

    W1  one request,   n=1,   1 token        time to first token
    W2  one request,   n=100, 1 token        shared prefill of one prompt
    W3  one request,   n=16,  T tokens       n-choice decode
    W4  16 concurrent, n=1,   T tokens       batched decode of 16 prompts
    W5  one request,   n=1,   T tokens       single-stream decode
    W6  one request,   n=1,   greedy         code edit: a stdlib function given back changed
    W7  one request,   n=1,   greedy         summary quoting a ~1500-token reference text

W1-W5 are streamed /v1/completions calls, each with its own prompt: a nonce, then about P
random words (the usage chunk reports the real token count), sent and timed by `plait
bench`'s client (plait/bench/). They send `ignore_eos`
and `min_tokens` = `max_tokens` (vLLM extras, which Plait accepts) so every choice makes
exactly its tokens; `--no-extras` leaves them out for a server that rejects them.
W6 and W7 are streamed /v1/chat/completions calls on real text the standard library ships
(plait/bench/texts.py), at temperature 0 and without extras: the answer is as long as the
model makes it (at most 640 / 384 tokens), and mostly repeats its context, the work that
speculative decoding speeds up. They are the same on every server, so greedy outputs can
be compared.

`--prefill-repeat N` runs W1 and W2 N times in a row on each start, each time with fresh
prompts: one prefill is a single sample of a host whose speed drifts, so W1's TTFT p50 is
then a median of N (the p99 the slowest).

`--rounds R` runs the servers R times in turn (A, B, ..., then A, B, ... again), each round
a fresh start, so that a slow spell of a shared host falls on every server alike; each
figure printed is then the median over the rounds, tok/s and TTFT p50 with their range,
and `--json` keeps every round.

Per workload: wall time, output tokens (from usage) and tokens/s, time to first token and
inter-token latency p50/p99 over all choices (a token = a chunk with non-empty text for that
choice), decode tokens/s (after the first token: (tokens - 1) / (last - first token time),
the figure speculation moves), the delta of Plait's `plait_prompt_tokens_computed_total`
from /metrics where the server exports it, and the speculative decoding counters' deltas
(vLLM's `vllm:spec_decode_*`, which Plait exports too) with the acceptance rate where the
server has them. Resident memory: the VmRSS of every process in the server's process group
(the API server, an engine child, vLLM's EngineCore and workers), summed (memory-mapped
weight files count as far as they are resident): right after the workloads, before the
server is stopped; the peak of a sample every 0.5 s while they ran; and with `--idle-wait
S`, once more after S seconds without requests (a server that gives memory back when idle,
as Plait's engine does after `--idle-memory-release-s`, shows it there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from plait.bench.client import CHAT, COMPLETIONS, StreamResult, make_client, stream_request
from plait.bench.launch import launch_command
from plait.bench.metrics import latency_samples, percentile
from plait.bench.runner import RequestRecord
from plait.bench.spec_metrics import fetch_metrics, scrape_spec, spec_delta
from plait.bench.texts import text_prompt
from plait.bench.workloads import random_words

# name -> (concurrent requests, n, max_tokens or None for --tokens)
WORKLOADS: dict[str, tuple[int, int, int | None]] = {
    "W1": (1, 1, 1), "W2": (1, 100, 1), "W3": (1, 16, None), "W4": (16, 1, None),
    "W5": (1, 1, None), "W6": (1, 1, 0), "W7": (1, 1, 0)}
# the text workloads (plait/bench/texts.py): their own chat prompt and max_tokens
TEXT_WORKLOADS = {"W6": "edit", "W7": "quote"}
COMPUTED_METRICS = ("plait_prompt_tokens_computed_total", "plait_prompt_tokens_computed")


@dataclass
class Result:
    """One workload on one server; latencies in milliseconds."""

    requests: int
    n: int
    max_tokens: int
    expected_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    decode_tok_s: float | None
    prompt_tokens: list[int]
    prompt_tokens_computed: float | None
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted_tokens: float | None
    acceptance_rate: float | None
    errors: list[str]


def make_prompt(words: int) -> str:
    """A prompt no other request shares a first token with: a nonce, then random words."""
    nonce = uuid.uuid4().hex[:12]
    return f"[{nonce}] " + random_words(random.Random(nonce), words)


async def scrape_computed(client: httpx.AsyncClient) -> float | None:
    """Plait's prompt-tokens-computed counter, None if the server has no such metric."""
    text = await fetch_metrics(client)
    for line in (text or "").splitlines():
        name, _, value = line.rpartition(" ")
        if name in COMPUTED_METRICS:
            return float(value)
    return None


def workload_bodies(model: str, name: str, args) -> tuple[str, list[dict[str, Any]]]:
    """(endpoint, request bodies) of one workload."""
    concurrent, n, max_tokens = WORKLOADS[name]
    if name in TEXT_WORKLOADS:  # greedy chat on real text, ended by the model
        prompt = text_prompt(TEXT_WORKLOADS[name])
        return CHAT, [{"model": model, "messages": prompt.messages, "temperature": 0.0,
                       "max_tokens": prompt.max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}]
    max_tokens = max_tokens or args.tokens
    bodies = [{"model": model, "prompt": make_prompt(args.prompt_tokens), "n": n,
               "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(concurrent)]
    if not args.no_extras:
        for body in bodies:
            body.update(ignore_eos=True, min_tokens=max_tokens)
    return COMPLETIONS, bodies


def decode_tok_s(streams: list[StreamResult]) -> float | None:
    """Tokens after each choice's first over the time from its first to its last chunk,
    summed over choices (None when no choice has two chunks)."""
    tokens, seconds = 0.0, 0.0
    for stream in streams:
        chunks = sum(len(times) for times in stream.token_times.values())
        for times in stream.token_times.values():
            if len(times) < 2:
                continue
            # usage counts tokens; a chunk may carry several (speculation): share them out
            share = (stream.completion_tokens or chunks) * len(times) / chunks
            tokens += share - 1
            seconds = max(seconds, times[-1] - times[0])
    return tokens / seconds if seconds > 0 else None


async def run_workload(client: httpx.AsyncClient, model: str, name: str, args) -> Result:
    """One workload's requests, measured; the one-token workloads (W1, W2) repeated
    `args.prefill_repeat` times one after another, each time with fresh prompts, their
    latencies pooled."""
    repeat = args.prefill_repeat if WORKLOADS[name][2] == 1 else 1
    before, spec_before = await scrape_computed(client), await scrape_spec(client)
    bodies: list[dict[str, Any]] = []
    streams: list[StreamResult] = []
    start = time.perf_counter()
    for _ in range(repeat):
        endpoint, batch = workload_bodies(model, name, args)
        bodies += batch
        streams += await asyncio.gather(*(stream_request(client, endpoint, body)
                                          for body in batch))
    wall = time.perf_counter() - start
    after, spec = await scrape_computed(client), spec_delta(spec_before,
                                                            await scrape_spec(client))
    samples = latency_samples([RequestRecord(i, 0.0, s) for i, s in enumerate(streams)])
    ttfts, itls = [t * 1000 for t in samples.ttft], [t * 1000 for t in samples.itl]
    output = sum(s.completion_tokens or 0 for s in streams)
    n, max_tokens = bodies[0].get("n", 1), bodies[0]["max_tokens"]
    return Result(
        requests=len(bodies), n=n, max_tokens=max_tokens,
        expected_tokens=len(bodies) * n * max_tokens, output_tokens=output, wall_s=wall,
        output_tok_s=output / wall if wall > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 0.5), ttft_p99_ms=percentile(ttfts, 0.99),
        itl_p50_ms=percentile(itls, 0.5), itl_p99_ms=percentile(itls, 0.99),
        decode_tok_s=decode_tok_s(streams),
        prompt_tokens=[s.prompt_tokens or 0 for s in streams],
        prompt_tokens_computed=None if before is None or after is None else after - before,
        spec_drafts=None if spec is None else spec.drafts,
        spec_draft_tokens=None if spec is None else spec.draft_tokens,
        spec_accepted_tokens=None if spec is None else spec.accepted_tokens,
        acceptance_rate=None if spec is None else spec.acceptance_rate,
        errors=[s.error for s in streams if s.error])


# ---------------------------------------------------------------- server processes
def group_rss_bytes(pgid: int) -> int:
    """Summed VmRSS of every live process in process group `pgid` (0 if none is readable)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces: the fields after it are after ")"
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


class PeakRss:
    """The largest `group_rss_bytes(pgid)` seen by a thread sampling every `every_s` seconds
    while the `with` block runs (`bytes`; 0 before the first sample)."""

    def __init__(self, pgid: int, every_s: float = 0.5) -> None:
        self.pgid, self.every_s, self.bytes = pgid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, group_rss_bytes(self.pgid))
            if self._stop.wait(self.every_s):
                return


def wait_ready(process: subprocess.Popen, url: str, timeout: float) -> str:
    """Poll until the server is ready; returns the model name. Raises RuntimeError."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"exited with status {process.returncode}")
            try:
                health = client.get("/health").status_code
                if health in (200, 404):
                    models = client.get("/v1/models")
                    if models.status_code == 200 and models.json().get("data"):
                        return models.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


async def bench_server(url: str, model: str, args) -> dict[str, Any]:
    async with make_client(url, args.api_key, args.request_timeout, 64) as client:
        warm = await stream_request(client, COMPLETIONS, {
            "model": model, "prompt": make_prompt(8), "max_tokens": 1, "stream": True})
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        return {name: asdict(await run_workload(client, model, name, args))
                for name in args.workloads}


def run_server(name: str, command: str, args) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "command": command, "log": None, "error": None,
                             "model": None, "startup_s": None, "workloads": {},
                             "rss_bytes": None, "rss_peak_bytes": None, "rss_idle_bytes": None}
    began = time.monotonic()
    try:
        server = launch_command(command, log_prefix=f"bench-{name}-")
    except (OSError, ValueError) as exc:
        entry["error"] = f"cannot start: {exc}"
        return entry
    entry["log"] = str(server.log_path)
    try:
        entry["model"] = wait_ready(server.process, server.url, args.startup_timeout)
        entry["startup_s"] = time.monotonic() - began
        print(f"[{name}] ready in {entry['startup_s']:.1f} s, model {entry['model']}",
              file=sys.stderr)
        with PeakRss(server.process.pid) as peak:
            entry["workloads"] = asyncio.run(bench_server(server.url, entry["model"], args))
        entry["rss_bytes"] = group_rss_bytes(server.process.pid)
        entry["rss_peak_bytes"] = max(peak.bytes, entry["rss_bytes"])
        if args.idle_wait > 0:
            time.sleep(args.idle_wait)
            entry["rss_idle_bytes"] = group_rss_bytes(server.process.pid)
    except RuntimeError as exc:
        tail = server.log()[-1500:]
        entry["error"] = str(exc)
        print(f"[{name}] FAILED: {exc} (log {server.log_path}):\n{tail}", file=sys.stderr)
    finally:
        server.stop()
    return entry


# ---------------------------------------------------------------- rounds
# Result fields that are the same in every round; the others are per-round measurements.
_SAME = ("requests", "n", "max_tokens", "expected_tokens")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def merge_rounds(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's entries from `run_server`, a round each, as one entry: each workload's
    measurements the median over the rounds it ran in (output tokens the fewest, errors all
    of them, prompt tokens every round's), the startup time and resident memory the median,
    the first error; `rounds` keeps the entries. One entry is returned as it is."""
    if len(entries) == 1:
        return entries[0]
    first = entries[0]
    merged: dict[str, Any] = {
        "name": first["name"], "command": first["command"],
        "log": [e["log"] for e in entries],
        "error": next((e["error"] for e in entries if e["error"]), None),
        "model": next((e["model"] for e in entries if e["model"]), None),
        "startup_s": _median([e["startup_s"] for e in entries]),
        **{key: _median([e.get(key) for e in entries])
           for key in ("rss_bytes", "rss_peak_bytes", "rss_idle_bytes")},
        "workloads": {}, "rounds": entries}
    for name in dict.fromkeys(name for e in entries for name in e["workloads"]):
        runs = [e["workloads"][name] for e in entries if name in e["workloads"]]
        result: dict[str, Any] = {key: runs[0][key] for key in _SAME}
        for key in runs[0]:
            if key in _SAME:
                continue
            if key == "output_tokens":
                result[key] = min(r[key] for r in runs)
            elif key in ("errors", "prompt_tokens"):
                result[key] = [item for r in runs for item in r[key]]
            else:
                result[key] = _median([r[key] for r in runs])
        result["rounds"] = len(runs)
        result["output_tok_s_range"] = [min(r["output_tok_s"] for r in runs),
                                        max(r["output_tok_s"] for r in runs)]
        ttfts = [r["ttft_p50_ms"] for r in runs if r["ttft_p50_ms"] is not None]
        result["ttft_p50_ms_range"] = [min(ttfts), max(ttfts)] if ttfts else None
        merged["workloads"][name] = result
    return merged


# ---------------------------------------------------------------- report
def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ranged(value: float | None, bounds: list[float] | None) -> str:
    """The value, and with several rounds their range: "193.2 (187.0-196.0)"."""
    if bounds is None or value is None:
        return _fmt(value)
    return f"{_fmt(value)} ({_fmt(bounds[0])}-{_fmt(bounds[1])})"


def _accepted(result: dict[str, Any]) -> str:
    """"30/48 (62.5%)": accepted of drafted tokens, or "-" without the counters."""
    drafted, accepted = result.get("spec_draft_tokens"), result.get("spec_accepted_tokens")
    if drafted is None or accepted is None:
        return "-"
    rate = f" ({100 * accepted / drafted:.1f}%)" if drafted else ""
    return f"{accepted:.0f}/{drafted:.0f}{rate}"


def table(servers: list[dict[str, Any]]) -> str:
    head = ("server", "load", "wall s", "tokens", "tok/s", "decode tok/s", "TTFT p50",
            "TTFT p99", "ITL p50", "ITL p99", "prompt computed", "accepted")
    rows = [head]
    for server in servers:
        if server["error"]:
            rows.append((server["name"], "FAILED", server["error"][:60], *[""] * 9))
        for name, r in server["workloads"].items():
            tokens = f"{r['output_tokens']}/{r['expected_tokens']}"
            if r["errors"]:
                tokens += f" ({len(r['errors'])} err)"
            rows.append((server["name"], name, _fmt(r["wall_s"], 2), tokens,
                         _ranged(r["output_tok_s"], r.get("output_tok_s_range")),
                         _fmt(r.get("decode_tok_s")),
                         _ranged(r["ttft_p50_ms"], r.get("ttft_p50_ms_range")),
                         _fmt(r["ttft_p99_ms"]), _fmt(r["itl_p50_ms"]), _fmt(r["itl_p99_ms"]),
                         _fmt(r["prompt_tokens_computed"], 0), _accepted(r)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["W6/W7 tokens = output/max_tokens: greedy, ended by the model"] if any(
        name in TEXT_WORKLOADS for server in servers for name in server["workloads"]) else []
    lines += [_memory_line(server) for server in servers if server.get("rss_bytes")]
    rounds = max((len(server.get("rounds", [server])) for server in servers), default=1)
    note = f"; medians of {rounds} rounds, (min-max)" if rounds > 1 else ""
    return "\n".join(lines) + f"\n(latencies in ms; tokens = output/expected{note})"


def _memory_line(server: dict[str, Any]) -> str:
    line = f"{server['name']}: resident memory after the run {server['rss_bytes'] / 1e9:.2f} GB"
    if server.get("rss_peak_bytes"):
        line += f", peak while it ran {server['rss_peak_bytes'] / 1e9:.2f} GB"
    if server.get("rss_idle_bytes"):
        line += f", after the idle wait {server['rss_idle_bytes'] / 1e9:.2f} GB"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", default=[], metavar="NAME=COMMAND",
                        help="a server to start; COMMAND contains {port} (repeatable)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of W1..W7 (default: all)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="output tokens per choice in W3/W4/W5")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="random words per prompt (about one token each)")
    parser.add_argument("--no-extras", action="store_true",
                        help="do not send the vLLM extras ignore_eos / min_tokens")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="S",
                        help="after the workloads, wait S seconds and read the resident "
                             "memory again (0: do not)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers this many times in turn; report medians")
    parser.add_argument("--prefill-repeat", type=int, default=1, metavar="N",
                        help="run the one-token workloads (W1, W2) N times one after "
                             "another, each with fresh prompts; their TTFT percentiles "
                             "over all N")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    if not args.server:
        parser.error("give at least one --server NAME='COMMAND with {port}'")
    servers = []
    for spec in args.server:
        name, sep, command = spec.partition("=")
        if not sep or not name or "{port}" not in command:
            parser.error(f"--server {spec!r}: expected NAME='COMMAND with {{port}}'")
        servers.append((name, command))
    args.server = servers
    args.workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if args.tokens < 1 or args.prompt_tokens < 1 or args.rounds < 1:
        parser.error("--tokens, --prompt-tokens and --rounds must be >= 1")
    if args.prefill_repeat < 1:
        parser.error("--prefill-repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds: list[list[dict[str, Any]]] = [[] for _ in args.server]
    for turn in range(args.rounds):
        if args.rounds > 1:
            print(f"round {turn + 1} of {args.rounds}", file=sys.stderr)
        for entries, (name, command) in zip(rounds, args.server, strict=True):
            entries.append(run_server(name, command, args))
    servers = [merge_rounds(entries) for entries in rounds]
    print(table(servers))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {"tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                  "workloads": args.workloads, "extras": not args.no_extras,
                  "rounds": args.rounds, "prefill_repeat": args.prefill_repeat}
        args.json.write_text(json.dumps({"config": config, "servers": servers}, indent=2))
    return 0 if all(not s["error"] for s in servers) else 1


if __name__ == "__main__":
    sys.exit(main())
