"""`plait bench [options]`: run a workload against an OpenAI-compatible server and report
request throughput, output tok/s, TTFT, TPOT, inter-token and end-to-end latency
(mean / p50 / p90 / p99); `--json` keeps every measurement, `--plot` draws PNGs, and
`plait bench --compare A.json B.json` puts two runs side by side.

Exit status: 0 when at least one request succeeded, 1 when none did or the server could
not be reached, 2 for bad options or a bad dataset (found before any request is sent).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from plait.bench.client import CHAT, COMPLETIONS, is_chat
from plait.bench.texts import TEXT_KINDS, text_prompt
from plait.bench.workloads import DEFAULT_N, WORKLOAD_KINDS, DatasetError, Workload

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_REQUESTS = 100
DEFAULT_OUTPUT_LEN = 128


class BenchError(RuntimeError):
    """A run that cannot go on (server unreachable, warm-up request refused)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 or inf, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to the `plait` parser's subcommands."""
    bench = commands.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (Plait or another)",
        description=__doc__.split("\n\n")[0].replace("`plait bench [options]`: ", "").strip())
    add = bench.add_argument
    add("--url", default=DEFAULT_URL, help="the server's root URL, without /v1 "
        f"(default: {DEFAULT_URL})")
    add("--endpoint", default=None, help=f"{COMPLETIONS} or {CHAT} (default: {CHAT} for "
        f"the text workloads {', '.join(TEXT_KINDS)}, else {COMPLETIONS})")
    add("--model", default=None, help="model name to send (default: the first of /v1/models)")
    add("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    add("--workload", choices=WORKLOAD_KINDS, default=None,
        help="random: fixed-length random prompts; shared: the same with n choices per "
             "prompt; dataset: --dataset FILE; edit (W6): a stdlib function to give back "
             "with one change; quote (W7): a summary quoting a long stdlib text (default: "
             "dataset with --dataset, else random)")
    add("--dataset", type=Path, default=None, metavar="FILE",
        help='JSONL, one {"prompt": str} or {"messages": [...]} per line, optional '
             '"max_tokens"')
    add("--num-requests", type=_positive_int, default=None,
        help=f"requests to send (default: {DEFAULT_NUM_REQUESTS}; a dataset: its lines; "
             "edit, quote: 1)")
    add("--input-len", type=_positive_int, default=256, help="prompt tokens (default: 256)")
    add("--output-len", type=_positive_int, default=None,
        help=f"max_tokens per choice (default: {DEFAULT_OUTPUT_LEN}; a dataset: its "
             "max_tokens, else the server's default; edit, quote: their own)")
    add("--n", type=_positive_int, default=None,
        help=f"choices per request (default: {DEFAULT_N['shared']} for shared, else 1)")
    add("--concurrency", type=_positive_int, default=None,
        help="most requests in flight (default: no limit)")
    add("--request-rate", type=_rate, default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)")
    add("--seed", type=int, default=0, help="seed of the prompts and arrivals (default: 0)")
    add("--temperature", type=float, default=None,
        help="sampling temperature (default: 1.0; edit, quote: 0, greedy)")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
        help="send ignore_eos (a vLLM/Plait extra) so every choice makes --output-len "
             "tokens; --no-ignore-eos for servers that refuse unknown fields (default: on; "
             "edit, quote: off, the model ends its answer)")
    add("--tokenize", action=argparse.BooleanOptionalAction, default=True,
        help="fit random prompts to exactly --input-len tokens with the server's /tokenize "
             "where it has one (default: on)")
    add("--extra-body", type=_json_object, default={}, metavar="JSON",
        help="JSON object merged into every request body")
    add("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    add("--progress", action=argparse.BooleanOptionalAction, default=True,
        help="progress bar on stderr (default: on)")
    add("--json", type=Path, default=None, metavar="PATH",
        help="write the summary and every request's measurements here")
    add("--plot", type=Path, default=None, metavar="DIR",
        help="write latency_cdf.png and throughput.png here (needs matplotlib)")
    add("--compare", type=Path, nargs=2, default=None, metavar=("A.json", "B.json"),
        help="print two --json results side by side with B/A ratios, and exit")
    return bench


def resolve(args: argparse.Namespace) -> tuple[Workload, list | None]:
    """The workload the options ask for, and the dataset's requests (None unless the
    workload is a dataset). Fills in the options whose default depends on the kind
    (endpoint, temperature, ignore_eos). Raises ValueError / DatasetError with the message
    to print."""
    kind = args.workload or ("dataset" if args.dataset else "random")
    if (kind == "dataset") != (args.dataset is not None):
        raise ValueError("--dataset FILE goes with --workload dataset (and only with it)")
    text = kind in TEXT_KINDS
    if args.endpoint is None:
        args.endpoint = CHAT if text else COMPLETIONS
    if args.temperature is None:
        args.temperature = 0.0 if text else 1.0
    if args.ignore_eos is None:
        args.ignore_eos = not text
    if text and not is_chat(args.endpoint):
        raise ValueError(f"--workload {kind} is a chat workload; use --endpoint {CHAT}")
    if not args.endpoint.rstrip("/").endswith("/completions"):
        raise ValueError(f"--endpoint {args.endpoint}: expected {COMPLETIONS} or {CHAT}")
    dataset = None
    if kind == "dataset":
        from plait.bench.workloads import load_dataset

        dataset = load_dataset(args.dataset)
        if not is_chat(args.endpoint) and any(s.messages is not None for s in dataset):
            raise DatasetError(f"{args.dataset} holds chat requests (messages); "
                               f"use --endpoint {CHAT}")
    num_requests = args.num_requests or (
        None if dataset else 1 if text else DEFAULT_NUM_REQUESTS)
    output_len = args.output_len or (None if dataset or text else DEFAULT_OUTPUT_LEN)
    return Workload(kind, num_requests, args.input_len, output_len, args.n, args.dataset,
                    args.seed), dataset


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Carry out `plait bench` as parsed into `args`; `argv` is kept in the JSON file."""
    from plait.bench.plots import PlotError, require_matplotlib
    from plait.bench.report import compare

    try:
        if args.compare:
            print(compare(*args.compare))
            return 0
        workload, dataset = resolve(args)
        if args.plot is not None:
            require_matplotlib()
    except (ValueError, PlotError) as exc:
        print(f"plait bench: error: {exc}", file=sys.stderr)
        return 2
    from plait.bench.session import bench

    try:
        return bench(args, workload, dataset, ["plait", "bench", *argv])
    except BenchError as exc:
        print(f"plait bench: error: {exc}", file=sys.stderr)
        return 1


def config_of(args: argparse.Namespace, workload: Workload, model: str) -> dict[str, Any]:
    """The run's settings as kept in the JSON file."""
    return {"url": args.url, "endpoint": args.endpoint, "model": model,
            "workload": workload.kind, "num_requests": workload.num_requests,
            "input_len": (None if workload.kind == "dataset" or workload.kind in TEXT_KINDS
                          else workload.input_len),
            "output_len": workload.output_len, "n": workload.n or DEFAULT_N[workload.kind],
            "dataset": str(workload.dataset) if workload.dataset else None,
            "text": text_prompt(workload.kind).source if workload.kind in TEXT_KINDS else None,
            "request_rate": args.request_rate, "concurrency": args.concurrency,
            "seed": args.seed, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "extra_body": args.extra_body}
