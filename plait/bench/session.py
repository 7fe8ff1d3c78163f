"""One `plait bench` run against a server: find the model, build the requests (fitting
prompt lengths with /tokenize), send one warm-up request, run, then print, save and plot.
Speculative decoding's counters are read from /metrics before and after the run (where the
server has them) and their difference reported with the acceptance rate."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from plait.bench.cli import BenchError, config_of
from plait.bench.client import (
    BodyOptions,
    RequestSpec,
    count_tokens,
    first_model,
    is_chat,
    make_client,
    request_body,
    stream_request,
)
from plait.bench.metrics import Summary, summarize
from plait.bench.report import format_summary, write_json
from plait.bench.runner import RunResult, run_requests
from plait.bench.spec_metrics import SpecCounters, scrape_spec, spec_delta
from plait.bench.texts import TEXT_KINDS
from plait.bench.workloads import DEFAULT_N, Workload, build_requests

MAX_CONNECTIONS = 1024  # the client's pool when --concurrency sets no lower cap


async def _run(args: argparse.Namespace, workload: Workload, dataset: list[RequestSpec] | None
               ) -> tuple[str, RunResult, list[int | None], SpecCounters | None]:
    """(model, the run, each request's measured prompt tokens, the speculative decoding
    counters' increase over the run or None)."""
    connections = min(args.concurrency or MAX_CONNECTIONS, MAX_CONNECTIONS)
    async with make_client(args.url, args.api_key, args.timeout, connections) as client:
        model = args.model or await first_model(client)
        chat = is_chat(args.endpoint)

        no_tokenize = False  # once /tokenize fails, every later prompt goes unmeasured

        async def count(text: str) -> int | None:
            nonlocal no_tokenize
            if no_tokenize:
                return None
            spec = (RequestSpec(messages=[{"role": "user", "content": text}]) if chat
                    else RequestSpec(prompt=text))
            measured = await count_tokens(client, model, spec)
            no_tokenize = measured is None
            return measured

        specs, expected = await build_requests(
            workload, count if args.tokenize else None, dataset)
        options = BodyOptions(model, args.temperature, args.ignore_eos, args.extra_body)
        bodies = [request_body(spec, args.endpoint, options) for spec in specs]
        warm = dict(bodies[0], max_tokens=1, n=1)
        if workload.kind in TEXT_KINDS:  # not the measured prompt: its prefill is measured
            warm["messages"] = [{"role": "user", "content": "Say hello."}]
        warm_result = await stream_request(client, args.endpoint, warm)
        if warm_result.error is not None:
            hint = (" (a server that refuses ignore_eos needs --no-ignore-eos)"
                    if args.ignore_eos else "")
            raise BenchError(f"the warm-up request failed: {warm_result.error}{hint}")
        spec_before = await scrape_spec(client)
        run = await run_requests(client, args.endpoint, bodies, args.request_rate,
                                 args.concurrency, args.seed, args.progress)
        spec = spec_delta(spec_before, await scrape_spec(client))
    return model, run, expected, spec


def _title(workload: Workload, model: str, args: argparse.Namespace,
           summary: Summary) -> str:
    n = workload.n or DEFAULT_N[workload.kind]
    shape = ("" if workload.kind == "dataset"
             else f", {workload.input_len} prompt tokens")
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    return (f"plait bench: {model} at {args.url}{args.endpoint}\n"
            f"{workload.kind} workload, {summary.num_requests} requests x n={n}{shape}, "
            f"max_tokens {workload.output_len or 'default'}, rate {rate}, concurrency "
            f"{args.concurrency or 'unlimited'}")


def bench(args: argparse.Namespace, workload: Workload, dataset: list[RequestSpec] | None,
          command: list[str]) -> int:
    """Run, print the table, write --json and --plot. Raises BenchError."""
    try:
        model, run, expected, spec = asyncio.run(_run(args, workload, dataset))
    except RuntimeError as exc:  # first_model's: the server is unreachable or lists nothing
        raise BenchError(str(exc)) from None
    summary = summarize(run)
    title = _title(workload, model, args, summary)
    print(format_summary(summary, title))
    if spec is not None:
        print(f"speculative decoding: {spec.describe()}")
    if args.json is not None:
        write_json(args.json, run, summary, config_of(args, workload, model), command,
                   expected, spec)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from plait.bench.plots import write_plots

        for path in write_plots(run, Path(args.plot), title):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if summary.completed else 1
