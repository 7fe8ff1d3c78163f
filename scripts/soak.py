"""Soak test: K concurrent streaming clients for T seconds against a real `plait serve`.

    python scripts/soak.py -k 16 -t 60                       # starts its own server
    python scripts/soak.py -k 6 -t 20 --url URL --pid PID --api-key KEY   # an existing one

Each client loops until T: chat or completions, n in 1..8, max_tokens in 1..--max-tokens,
always streamed; a share of the requests (--disconnect-share) hangs up after a random delay,
before the first token or mid-stream. Then it checks: no 5xx and no in-stream error, every
finished stream ended with [DONE], finished + refused + aborted == sent, once idle no KV
block in use (plait_kv_blocks_used 0: kept prompts hold no block), server RSS growth under
--max-rss-growth-mb. It prints K, T, requests served, refusals, p50/p99 time to first
token, and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from plait.bench.launch import launch_plait

# A fixed pool: each prompt's shared prefill stays pinned (prompt sharing), so the blocks in
# use at rest are the same before and after the soak.
PROMPTS = ["Once upon a time", "The capital of France is", "List three colours:",
           "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Explain gravity to a child.", "The best way to learn a language is"]


@dataclass
class Tally:
    """Client-side accounting of every request sent."""

    sent: int = 0
    finished: int = 0  # streamed to [DONE]
    refused: int = 0  # 503 overloaded, as an envelope with Retry-After
    aborted: int = 0  # hung up on purpose
    errors: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def random_request(rng: random.Random, max_tokens: int,
                   model: str) -> tuple[str, dict[str, Any]]:
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"model": model, "n": rng.randint(1, 8), "stream": True,
                            "max_tokens": rng.randint(1, max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def stream_one(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     tally: Tally, seen: dict[str, bool]) -> None:
    """Send one request and account for it (unless cancelled: the caller counts that)."""
    start = time.monotonic()
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            seen["answered"] = seen["refused"] = True
            _account_refusal(response, text, tally)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                seen["answered"] = True
                tally.finished += 1
                return
            event = json.loads(data)
            if "error" in event:
                seen["answered"] = True
                tally.errors.append(f"in-stream error: {event['error']}")
                return
            text = "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                           for c in event["choices"])
            if text and "ttft" not in seen:
                seen["ttft"] = True
                tally.ttfts.append(time.monotonic() - start)
    seen["answered"] = True
    tally.errors.append("stream ended without [DONE]")


def _account_refusal(response: httpx.Response, text: str, tally: Tally) -> None:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        tally.errors.append(f"{response.status_code} without an envelope: {text[:200]}")
        return
    if (response.status_code == 503 and error.get("code") == "overloaded"
            and response.headers.get("retry-after")):
        tally.refused += 1
    else:
        tally.errors.append(f"{response.status_code}: {error}")


async def client_loop(client: httpx.AsyncClient, rng: random.Random, deadline: float,
                      tally: Tally, max_tokens: int, disconnect_share: float,
                      model: str) -> None:
    while time.monotonic() < deadline:
        path, body = random_request(rng, max_tokens, model)
        hang_up = rng.random() < disconnect_share
        seen: dict[str, bool] = {}
        tally.sent += 1
        task = asyncio.ensure_future(stream_one(client, path, body, tally, seen))
        try:
            await asyncio.wait_for(task, rng.uniform(0.05, 3.0) if hang_up else None)
        except TimeoutError:
            if not seen.get("answered"):
                tally.aborted += 1
        except Exception as exc:  # a transport error or a malformed event: a failure
            tally.errors.append(f"{type(exc).__name__}: {exc}")
        if seen.get("refused"):
            await asyncio.sleep(rng.uniform(0.0, 1.0))  # back off, as Retry-After asks


async def server_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")}


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        gauges = await server_gauges(client)
        idle = gauges["plait_num_requests_running"] == gauges["plait_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.2)


async def served_model(client: httpx.AsyncClient) -> str:
    """The name the server serves (it may be --served-model-name)."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def warm(client: httpx.AsyncClient, model: str) -> None:
    """Every pool prompt once on both endpoints (pins its shared prefill)."""
    for prompt in PROMPTS:
        for path, extra in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}]})):
            response = await client.post(path, json={"model": model, "max_tokens": 1, **extra})
            response.raise_for_status()


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as fh:
        kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return kb / 1024


async def soak(url: str, *, k: int, seconds: float, api_key: str | None = None,
               pid: int | None = None, max_tokens: int = 64, disconnect_share: float = 0.2,
               seed: int = 0) -> dict[str, Any]:
    """Run the soak; returns the report (see `failures` for the verdict)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=k + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(300, connect=10)) as client:
        model = await served_model(client)
        await warm(client, model)
        before = (await wait_idle(client))["plait_kv_blocks_used"]
        rss_before = rss_mb(pid)
        tally = Tally()
        started = time.monotonic()
        deadline = started + seconds
        rngs = [random.Random(seed * 1000 + i) for i in range(k)]
        await asyncio.gather(*(client_loop(client, rng, deadline, tally, max_tokens,
                                           disconnect_share, model) for rng in rngs))
        elapsed = time.monotonic() - started
        idle = await wait_idle(client)
    return {"k": k, "seconds": seconds, "elapsed_s": round(elapsed, 1), "sent": tally.sent,
            "finished": tally.finished, "refused": tally.refused, "aborted": tally.aborted,
            "errors": tally.errors, "ttft_p50_s": percentile(tally.ttfts, 0.5),
            "ttft_p99_s": percentile(tally.ttfts, 0.99),
            "idle": idle["plait_num_requests_running"] + idle["plait_num_requests_waiting"] == 0,
            "kv_blocks_before": before, "kv_blocks_after": idle["plait_kv_blocks_used"],
            "rss_before_mb": rss_before, "rss_after_mb": rss_mb(pid)}


def failures(report: dict[str, Any], max_rss_growth_mb: float) -> list[str]:
    """What the report violates; empty when the soak passed."""
    found = [f"error: {e}" for e in report["errors"][:20]]
    accounted = report["finished"] + report["refused"] + report["aborted"]
    if accounted + len(report["errors"]) != report["sent"] or report["errors"]:
        found.append(f"accounting: finished+refused+aborted={accounted}, "
                     f"sent={report['sent']}, errors={len(report['errors'])}")
    if not report["idle"]:
        found.append("the engine did not go idle after the soak")
    for when in ("before", "after"):
        if report[f"kv_blocks_{when}"] != 0:
            found.append(f"{report[f'kv_blocks_{when}']:.0f} KV blocks in use at rest {when} "
                         "the soak")
    if report["rss_before_mb"] is not None:
        growth = report["rss_after_mb"] - report["rss_before_mb"]
        if growth > max_rss_growth_mb:
            found.append(f"RSS grew {growth:.0f} MB (limit {max_rss_growth_mb:.0f} MB)")
    return found


def summary(report: dict[str, Any]) -> str:
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rss = ("-" if report["rss_before_mb"] is None else
           f"{report['rss_before_mb']:.0f} -> {report['rss_after_mb']:.0f} MB")
    return "\n".join([
        f"K={report['k']} clients, T={report['seconds']:g} s (ran {report['elapsed_s']} s)",
        f"requests sent {report['sent']}: served {report['finished']}, refused (503) "
        f"{report['refused']}, aborted by the client {report['aborted']}, "
        f"errors {len(report['errors'])}",
        f"time to first token: p50 {secs(report['ttft_p50_s'])}, "
        f"p99 {secs(report['ttft_p99_s'])}",
        f"KV blocks in use at rest: "
        f"{report['kv_blocks_before']:.0f} before, {report['kv_blocks_after']:.0f} after; "
        f"server RSS {rss}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--clients", type=int, default=16)
    parser.add_argument("-t", "--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    parser.add_argument("--url", help="an existing server (default: start one)")
    parser.add_argument("--pid", type=int, help="the existing server's pid (for RSS)")
    parser.add_argument("--api-key")
    parser.add_argument("--server-args", default="", help="extra `plait serve` arguments")
    args = parser.parse_args(argv)
    server = None
    url, pid = args.url, args.pid
    if url is None:
        server = launch_plait(shlex.split(args.server_args), log_prefix="plait-soak-")
        print(f"starting plait serve at {server.url} (log: {server.log_path})", file=sys.stderr)
        try:
            server.wait_healthy(300)
        except RuntimeError as exc:
            server.stop()
            raise SystemExit(f"plait serve did not become healthy: {exc}") from None
        url, pid = server.url, server.process.pid
    try:
        report = asyncio.run(soak(url, k=args.clients, seconds=args.seconds,
                                  api_key=args.api_key, pid=pid, max_tokens=args.max_tokens,
                                  disconnect_share=args.disconnect_share, seed=args.seed))
    finally:
        if server is not None:
            server.stop()
    print(summary(report))
    problems = failures(report, args.max_rss_growth_mb)
    for problem in problems:
        print(f"FAIL {problem}")
    print("PASS" if not problems else "FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
