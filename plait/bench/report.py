"""What a run leaves behind: the printed table, the JSON file (every request's raw
measurements, the summary, the command line and a UTC timestamp), and `--compare`, which
prints two JSON files' summaries side by side with B/A ratios."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from plait.bench.metrics import PERCENTILES, Summary
from plait.bench.runner import RunResult
from plait.bench.spec_metrics import SpecCounters

FORMAT_VERSION = 1
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
THROUGHPUTS = (("request_throughput", "request throughput (req/s)"),
               ("output_throughput", "output throughput (tok/s)"),
               ("total_token_throughput", "total throughput (tok/s)"))
STATS = ("mean", *(f"p{p}" for p in PERCENTILES))


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     .rstrip() for row in rows)


def format_summary(summary: Summary, title: str) -> str:
    """The table `plait bench` prints after a run."""
    head = [
        ("requests", f"{summary.completed} completed, {summary.failed} failed"),
        ("duration", f"{summary.duration_s:.2f} s"),
        *((label, _num(getattr(summary, key))) for key, label in THROUGHPUTS),
        ("prompt tokens", "-" if summary.prompt_tokens is None else str(summary.prompt_tokens)),
        ("output tokens", f"{summary.output_tokens} (usage from {summary.requests_with_usage} "
                          f"of {summary.completed} requests)"),
    ]
    width = max(len(label) for label, _ in head)
    lines = [title, *(f"{label.ljust(width)}  {value}" for label, value in head), ""]
    rows = [("latency (ms)", "n", *STATS)]
    for key, label in LATENCIES:
        dist = getattr(summary, key)
        rows.append((label, str(dist.count), *(_num(getattr(dist, s)) for s in STATS)))
    lines.append(_columns(rows))
    if summary.errors:
        lines += ["", "errors:", *(f"  {count} x {message}"
                                   for message, count in summary.errors.items())]
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """JSON has no infinity: an infinite float (the request rate) is written "inf"."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def write_json(path: Path, run: RunResult, summary: Summary, config: dict[str, Any],
               command: list[str], expected_prompt_tokens: list[int | None],
               spec: SpecCounters | None = None) -> None:
    """Write the run to `path` (its folder is created); `spec`: the speculative decoding
    counters' increase over the run, kept with its rates (null without counters)."""
    requests = [{
        "index": r.index, "start_s": r.start_s, "e2e_s": r.result.e2e_s,
        "status": r.result.status, "error": r.result.error,
        "prompt_tokens": r.result.prompt_tokens,
        "expected_prompt_tokens": expected_prompt_tokens[r.index],
        "completion_tokens": r.result.completion_tokens, "output_tokens": r.result.output_tokens,
        "token_times_s": {str(i): t for i, t in sorted(r.result.token_times.items())},
    } for r in run.records]
    document = {
        "format": FORMAT_VERSION, "command": command,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {k: _jsonable(v) for k, v in config.items()},
        "summary": dataclasses.asdict(summary), "requests": requests,
        "spec_decode": None if spec is None else {
            **dataclasses.asdict(spec), "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def load_summary(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, summary) of a JSON file `plait bench --json` wrote. Raises ValueError."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a `plait bench --json` file")
    return document["config"], document["summary"]


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def compare(path_a: Path, path_b: Path) -> str:
    """Every throughput and latency statistic of A and B, and B/A."""
    (config_a, a), (config_b, b) = load_summary(path_a), load_summary(path_b)
    rows: list[tuple[str, ...]] = [("metric", "A", "B", "B/A")]
    for key, label in THROUGHPUTS:
        rows.append((label, _num(a[key]), _num(b[key]), _ratio(a[key], b[key])))
    for key, label in LATENCIES:
        for stat in STATS:
            va, vb = a[key][stat], b[key][stat]
            rows.append((f"{label} {stat} (ms)", _num(va), _num(vb), _ratio(va, vb)))
    rows.append(("failed requests", str(a["failed"]), str(b["failed"]), ""))

    def describe(name: str, path: Path, config: dict[str, Any], summary: dict[str, Any]) -> str:
        return (f"{name} = {path}: {config.get('workload')} workload, "
                f"{summary['num_requests']} requests, model {config.get('model')}, "
                f"{config.get('url')}")

    return "\n".join([describe("A", path_a, config_a, a), describe("B", path_b, config_b, b),
                      "", _columns(rows)])
