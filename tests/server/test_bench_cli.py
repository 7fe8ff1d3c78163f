"""`plait bench` end to end against a real `plait serve` (a tiny random-weight model): every
workload kind, the JSON file checked against its own raw measurements and the server's
usage, the PNG plots, --compare, server errors counted, and option / dataset errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.server import free_port, start_server

from plait.bench.runner import arrival_times
from plait.cli import main

KEY = "sk-bench-test"
MAX_MODEL_LEN = 256
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_path):
    server = start_server([str(tiny_path), "--num-kv-blocks", "256", "--max-num-seqs", "32",
                           "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
                           "--api-key", KEY], api_key=KEY)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def bench(server, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "plait", "bench", "--url", server.url, "--api-key", KEY,
               "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def nearest_rank(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def check_consistent(doc: dict[str, Any]) -> None:
    """The summary is exactly what the raw per-request measurements give."""
    summary, requests = doc["summary"], doc["requests"]
    ok = [r for r in requests if r["error"] is None]
    assert summary["num_requests"] == len(requests)
    assert (summary["completed"], summary["failed"]) == (len(ok), len(requests) - len(ok))
    assert summary["output_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert summary["requests_with_usage"] == len(ok)
    duration = summary["duration_s"]
    assert duration == pytest.approx(max(r["start_s"] + r["e2e_s"] for r in requests)
                                     - min(r["start_s"] for r in requests))
    assert summary["request_throughput"] == pytest.approx(len(ok) / duration)
    assert summary["output_throughput"] == pytest.approx(summary["output_tokens"] / duration)
    ttft = [t[0] * 1000 for r in ok for t in r["token_times_s"].values()]
    itl = [(b - a) * 1000 for r in ok for t in r["token_times_s"].values()
           for a, b in itertools.pairwise(t)]
    e2e = [r["e2e_s"] * 1000 for r in ok]
    for key, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        dist = summary[key]
        assert dist["count"] == len(values), key
        if not values:  # every choice's tokens came coalesced in one chunk: no ITL sample
            assert (key, dist["mean"], dist["p50"], dist["p99"]) == ("itl_ms", None, None, None)
            continue
        assert dist["mean"] == pytest.approx(sum(values) / len(values))
        assert [dist["p50"], dist["p90"], dist["p99"]] == [nearest_rank(values, p)
                                                          for p in (50, 90, 99)]
        assert dist["p50"] <= dist["p90"] <= dist["p99"]
    for r in ok:
        times = [t for ts in r["token_times_s"].values() for t in ts]
        assert 0 < min(times) <= max(times) <= r["e2e_s"]


def check_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, (path, len(data))
    pixels = matplotlib.image.imread(path)  # [H, W, 4] RGBA floats
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400 and pixels.shape[2] == 4
    assert pixels[..., :3].std() > 0.05  # drawn on, not a blank canvas


@pytest.fixture(scope="module")
def random_run(server, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("random")
    args = ("--num-requests", "4", "--input-len", "48", "--output-len", "5",
            "--concurrency", "2", "--json", str(out / "run.json"), "--plot", str(out))
    return out, bench(server, *args)


def test_random_workload_exact_lengths_json_and_plots(random_run, server) -> None:
    out, result = random_run
    assert result.returncode == 0, result.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["command"][:2] == ["plait", "bench"] and "--concurrency" in doc["command"]
    assert datetime.fromisoformat(doc["timestamp"]).tzinfo is not None
    model = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]
    expected = {"url": server.url, "endpoint": "/v1/completions", "model": model,
                "workload": "random", "num_requests": 4, "input_len": 48, "output_len": 5,
                "n": 1, "request_rate": "inf", "concurrency": 2, "ignore_eos": True}
    assert {key: doc["config"][key] for key in expected} == expected
    check_consistent(doc)
    assert [r["index"] for r in doc["requests"]] == [0, 1, 2, 3]
    for r in doc["requests"]:  # fitted through /tokenize to the exact length
        assert (r["prompt_tokens"], r["expected_prompt_tokens"]) == (48, 48)
        assert (r["completion_tokens"], r["status"], r["error"]) == (5, 200, None)
        assert list(r["token_times_s"]) == ["0"]
    assert doc["summary"]["prompt_tokens"] == 4 * 48
    assert doc["summary"]["output_tokens"] == 4 * 5
    assert "4 completed, 0 failed" in result.stdout
    assert f"plait bench: {model} at {server.url}/v1/completions" in result.stdout
    for name in ("latency_cdf.png", "throughput.png"):
        check_png(out / name)


def test_shared_workload_times_every_choice(server, tmp_path) -> None:
    result = bench(server, "--workload", "shared", "--n", "3", "--num-requests", "2",
                   "--input-len", "40", "--output-len", "4", "--request-rate", "20",
                   "--seed", "3", "--json", str(tmp_path / "shared.json"))
    assert result.returncode == 0, result.stderr
    doc = json.loads((tmp_path / "shared.json").read_text())
    check_consistent(doc)
    assert (doc["config"]["n"], doc["config"]["request_rate"]) == (3, 20.0)
    for r in doc["requests"]:
        assert (r["prompt_tokens"], r["completion_tokens"]) == (40, 12)  # prompt counted once
        assert sorted(r["token_times_s"]) == ["0", "1", "2"]
    assert doc["summary"]["ttft_ms"]["count"] == 6


def test_dataset_on_chat_counts_errors_and_goes_on(server, tmp_path) -> None:
    too_long = " ".join(["word"] * (MAX_MODEL_LEN + 50))
    rows = [{"prompt": "Name a colour.", "max_tokens": 2},
            {"messages": [{"role": "user", "content": "Count to three."}]},
            {"prompt": too_long}]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    result = bench(server, "--dataset", str(dataset), "--endpoint", "/v1/chat/completions",
                   "--output-len", "3", "--num-requests", "5", "--json",
                   str(tmp_path / "data.json"))
    assert result.returncode == 0, result.stderr
    doc = json.loads((tmp_path / "data.json").read_text())
    check_consistent(doc)
    requests = doc["requests"]
    assert [r["status"] for r in requests] == [200, 200, 400, 200, 200]
    assert [r["completion_tokens"] for r in requests] == [2, 3, None, 2, 3]
    assert requests[3]["prompt_tokens"] == requests[0]["prompt_tokens"]
    messages = httpx.post(f"{server.url}/tokenize", headers=server.headers,
                          json={"messages": rows[1]["messages"]}).json()["count"]
    assert requests[1]["prompt_tokens"] == requests[4]["prompt_tokens"] == messages
    ((error, count),) = doc["summary"]["errors"].items()
    assert count == 1 and error.startswith("HTTP 400: ") and error == requests[2]["error"]
    assert "4 completed, 1 failed" in result.stdout and f"1 x {error}" in result.stdout


def test_without_usage_chunks_are_counted(server, tmp_path) -> None:
    """A server that sends no usage: output tokens are the content chunks. Prompts are
    not fitted (--no-tokenize): 16 words, unmeasured."""
    result = bench(server, "--num-requests", "2", "--input-len", "16", "--output-len", "4",
                   "--no-tokenize",
                   "--extra-body", '{"stream_options": {"include_usage": false}}',
                   "--json", str(tmp_path / "nousage.json"))
    assert result.returncode == 0, result.stderr
    doc = json.loads((tmp_path / "nousage.json").read_text())
    summary, requests = doc["summary"], doc["requests"]
    assert [(r["prompt_tokens"], r["completion_tokens"], r["expected_prompt_tokens"])
            for r in requests] == [(None, None, None)] * 2
    chunks = [len(r["token_times_s"]["0"]) for r in requests]
    assert [r["output_tokens"] for r in requests] == chunks and all(0 < c <= 4 for c in chunks)
    assert (summary["output_tokens"], summary["prompt_tokens"]) == (sum(chunks), None)
    assert (summary["requests_with_usage"], summary["completed"]) == (0, 2)
    assert f"output tokens               {sum(chunks)} (usage from 0 of 2 requests)" \
        in result.stdout


def test_compare_prints_ratios(random_run, server, tmp_path) -> None:
    b_path = tmp_path / "b.json"
    assert bench(server, "--num-requests", "2", "--input-len", "16", "--output-len", "3",
                 "--json", str(b_path)).returncode == 0
    a_path = random_run[0] / "run.json"
    result = subprocess.run([sys.executable, "-m", "plait", "bench", "--compare", str(a_path),
                             str(b_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    a, b = (json.loads(p.read_text())["summary"] for p in (a_path, b_path))
    rows = {line.rsplit(maxsplit=3)[0]: line.rsplit(maxsplit=3)[1:]
            for line in result.stdout.splitlines()[3:]}
    for label, va, vb in (("output throughput (tok/s)", a["output_throughput"],
                           b["output_throughput"]),
                          ("TTFT p90 (ms)", a["ttft_ms"]["p90"], b["ttft_ms"]["p90"]),
                          ("E2E p99 (ms)", a["e2e_ms"]["p99"], b["e2e_ms"]["p99"])):
        assert rows[label] == [f"{va:.2f}", f"{vb:.2f}", f"{vb / va:.2f}x"], label
    assert result.stdout.startswith(f"A = {a_path}: random workload, 4 requests")


def test_warmup_refused_exits_1(server) -> None:
    result = bench(server, "--num-requests", "2", "--extra-body", '{"temperature": -1}')
    assert result.returncode == 1
    assert "plait bench: error: the warm-up request failed: HTTP 400" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_server_exits_1() -> None:
    result = subprocess.run([sys.executable, "-m", "plait", "bench", "--url",
                             f"http://127.0.0.1:{free_port()}", "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("plait bench: error: GET /v1/models failed: ")


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a"}\n{"prompt": "b"\n', ":2: not JSON (Expecting ',' delimiter)"),
    ('["a"]\n', ':1: expected an object with "prompt" or "messages"'),
    ('{"prompt": "a", "messages": []}\n', ':1: give exactly one of "prompt" and "messages"'),
    ('{"prompt": 7}\n', ':1: "prompt" must be a string'),
    ('{"messages": [{"content": "x"}]}\n',
     ':1: "messages" must be a non-empty list of objects with a "role"'),
    ('\n{"prompt": "a", "max_tokens": 0}\n', ':2: "max_tokens" must be an integer >= 1'),
    ('{"prompt": "a", "max_tokens": true}\n', ':1: "max_tokens" must be an integer >= 1'),
    ("\n\n", " holds no request"),
])
def test_bad_dataset_is_an_error_before_any_request(tmp_path, capsys, content: str,
                                                    message: str) -> None:
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text(content)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: no request may be sent
    assert main(["bench", "--url", url, "--dataset", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait bench: error: ") and message in err, err
    assert str(dataset) in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "dataset"], "--dataset FILE goes with --workload dataset"),
    (["--endpoint", "/v1/embeddings"],
     "--endpoint /v1/embeddings: expected /v1/completions or /v1/chat/completions"),
    (["--dataset", "/nonexistent/x.jsonl"], "cannot read dataset /nonexistent/x.jsonl"),
])
def test_option_errors(capsys, argv: list[str], message: str) -> None:
    assert main(["bench", "--url", f"http://127.0.0.1:{free_port()}", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("value", "message"), [
    ("[1]", "argument --extra-body: expected a JSON object, got [1]"),
    ("{bad", "argument --extra-body: not JSON (Expecting property name enclosed in double "
             "quotes): {bad"),
])
def test_extra_body_must_be_a_json_object(capsys, value: str, message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--extra-body", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_chat_dataset_needs_the_chat_endpoint(tmp_path, capsys) -> None:
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["bench", "--dataset", str(dataset)]) == 2
    assert "holds chat requests (messages); use --endpoint /v1/chat/completions" in \
        capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ImportError(name)
        sys.meta_path.insert(0, Block())
        from plait.cli import main
        sys.exit(main(["bench", "--url", "http://127.0.0.1:{free_port()}",
                       "--plot", {str(tmp_path)!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--plot needs matplotlib" in result.stderr
    assert "pip install 'plait[plot]'" in result.stderr


def test_help_lists_bench_and_stays_light() -> None:
    code = ("import sys\nfrom plait.cli import build_parser\nbuild_parser({})\n"
            "print(sorted(m for m in ('httpx', 'matplotlib', 'tqdm') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "[]", result.stderr
    top = subprocess.run([sys.executable, "-m", "plait", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert "bench" in top.stdout and "benchmark an OpenAI-compatible server" in top.stdout


def test_poisson_arrivals() -> None:
    assert arrival_times(4, math.inf, seed=0) == [0.0] * 4
    times = arrival_times(2000, 50.0, seed=1)
    assert times == arrival_times(2000, 50.0, seed=1) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)


@pytest.mark.parametrize("done", [True, False])
async def test_a_stream_cut_before_done_is_an_error(done: bool) -> None:
    """A server that closes the stream without `data: [DONE]` (a crash mid-answer) is
    counted as a failed request, not a short success."""
    from plait.bench.client import stream_request

    chunk = {"choices": [{"index": 0, "text": "hi"}]}
    events = f"data: {json.dumps(chunk)}\n\n" + ("data: [DONE]\n\n" if done else "")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n" + events.encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        result = await stream_request(client, "/v1/completions", {"prompt": "x"})
    assert result.num_chunks == 1 and result.done is done
    assert result.error == (None if done else "stream ended early (no [DONE])")
