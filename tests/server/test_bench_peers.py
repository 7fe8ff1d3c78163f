"""scripts/bench_peers.py end to end: a tiny-model `plait serve` and a command that fails."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from helpers.paths import SCRIPTS

SCRIPT = SCRIPTS / "bench_peers.py"


def test_bench_peers_reports_exact_token_counts(tmp_path, tiny_path) -> None:
    serve = (f"{shlex.quote(sys.executable)} -m plait serve {shlex.quote(str(tiny_path))} "
             "--port {port} --num-kv-blocks 128 --max-num-seqs 32 --log-level warning "
             "--idle-memory-release-s 0.5")
    out = tmp_path / "peers.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    if "PLAIT_CACHE" in os.environ:
        env["PLAIT_CACHE"] = os.environ["PLAIT_CACHE"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--server", "broken=false {port}",
         "--server", f"plait={serve}", "--workloads", "W1,W3,W5,W6", "--tokens", "8",
         "--prompt-tokens", "32", "--startup-timeout", "240", "--idle-wait", "1.5",
         "--prefill-repeat", "3", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr  # the broken server fails, the run goes on
    assert "[broken] FAILED: exited with status 1" in result.stderr
    report = json.loads(out.read_text())
    broken, plait = report["servers"]
    assert broken["name"] == "broken" and broken["workloads"] == {}
    assert plait["error"] is None, result.stderr
    assert plait["model"]  # the first name /v1/models lists
    assert list(plait["workloads"]) == ["W1", "W3", "W5", "W6"]
    assert report["config"]["prefill_repeat"] == 3
    w1, w3, w5 = (plait["workloads"][w] for w in ("W1", "W3", "W5"))
    def counts(w: dict) -> tuple[int, int, int, int]:
        return w["requests"], w["n"], w["output_tokens"], w["expected_tokens"]

    assert counts(w1) == (3, 1, 3, 3)  # --prefill-repeat: three requests one after another
    assert counts(w3) == (1, 16, 128, 128)  # the others once
    assert counts(w5) == (1, 1, 8, 8)
    # each of W1's three with a prompt of its own: all computed, none found in the cache
    assert len(w1["prompt_tokens"]) == 3 and min(w1["prompt_tokens"]) > 32
    assert w1["prompt_tokens_computed"] == sum(w1["prompt_tokens"])
    assert 0 < w1["ttft_p50_ms"] <= w1["ttft_p99_ms"] and w1["errors"] == []
    for w in (w3, w5):
        assert w["errors"] == []
        assert w["wall_s"] > 0 and w["output_tok_s"] > 0
        assert 0 < w["ttft_p50_ms"] <= w["ttft_p99_ms"]
    # ITL is measured between chunks. The tiny model's steps are so fast that tokens made
    # while the client reads coalesce into one chunk (server/merge.py), so W5's single
    # 8-token stream can arrive as one chunk: no ITL sample at all (at 4 tokens it failed CI so).
    # W3's 16 choices give samples.
    assert 0 < w3["itl_p50_ms"] <= w3["itl_p99_ms"]
    assert w5["itl_p50_ms"] is None or 0 < w5["itl_p50_ms"] <= w5["itl_p99_ms"]
    for w in (w3, w5):
        (prompt_tokens,) = w["prompt_tokens"]
        assert prompt_tokens > 32  # 32 words and a nonce
        # Plait computes each prompt once, however many choices share it.
        assert w["prompt_tokens_computed"] == prompt_tokens
    # W6: one greedy chat request on the stdlib function, ended by the model or max_tokens
    w6 = plait["workloads"]["W6"]
    assert (w6["requests"], w6["n"], w6["max_tokens"], w6["errors"]) == (1, 1, 640, [])
    assert 1 <= w6["output_tokens"] <= 640 and w6["prompt_tokens"][0] > 480
    assert w6["spec_drafts"] is None and w6["acceptance_rate"] is None  # no speculation
    for row in ("plait   W3", "plait   W5", "plait   W6", "128/128", "8/8"):
        assert row in result.stdout, result.stdout
    # resident memory of the server's process group, taken before it was stopped: a Python
    # server holding torch is hundreds of MB; the failed one has none
    assert plait["rss_bytes"] > 100e6 and broken["rss_bytes"] is None
    # sampled while the workloads ran (at least the reading after them), and read again
    # after --idle-wait
    assert plait["rss_peak_bytes"] >= plait["rss_bytes"] and plait["rss_idle_bytes"] > 100e6
    assert broken["rss_peak_bytes"] is None and broken["rss_idle_bytes"] is None
    assert "plait: resident memory after the run" in result.stdout
    assert "peak while it ran" in result.stdout and "after the idle wait" in result.stdout


def test_group_rss_counts_every_process_of_the_group() -> None:
    """A group of two processes, each holding ~100 MB: the sum is counted, not one of them."""
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_peers import group_rss_bytes

    # Each child holds its memory until killed (signal.pause: no timer to outlast).
    hold = "import signal; b = bytearray(100 * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
           "print('ready', flush=True); signal.pause()"
    parent = subprocess.Popen(
        ["sh", "-c", f'{shlex.quote(sys.executable)} -c "{hold}" & '
                     f'{shlex.quote(sys.executable)} -c "{hold}"; wait'],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        assert parent.stdout.readline().strip() == "ready"
        assert group_rss_bytes(parent.pid) > 200 * 2**20
        assert group_rss_bytes(2**22 + 12345) == 0  # no such group
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def _bench_peers():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_peers

    return bench_peers


def _result(tok_s: float, ttft: float | None, tokens: int = 128,
            errors: tuple[str, ...] = ()) -> dict:
    return {"requests": 1, "n": 1, "max_tokens": 128, "expected_tokens": 128,
            "output_tokens": tokens, "wall_s": 128 / tok_s, "output_tok_s": tok_s,
            "ttft_p50_ms": ttft, "ttft_p99_ms": ttft, "itl_p50_ms": None, "itl_p99_ms": None,
            "prompt_tokens": [520], "prompt_tokens_computed": 520.0, "errors": list(errors)}


def _entry(workloads: dict, rss: int | None, error: str | None = None) -> dict:
    return {"name": "a", "command": "serve {port}", "log": "a.log", "error": error,
            "model": None if error else "m", "startup_s": None if error else 4.0,
            "workloads": workloads, "rss_bytes": rss}


def test_merge_rounds_takes_each_measurement_median_over_the_rounds_it_ran_in() -> None:
    merge_rounds = _bench_peers().merge_rounds
    entries = [_entry({"W1": _result(2.0, 400.0), "W5": _result(80.0, 410.0)}, 1000),
               _entry({}, None, error="exited with status 1"),  # a round that failed
               _entry({"W1": _result(3.5, 300.0), "W5": _result(60.0, None, tokens=100,
                                                               errors=("cut",))}, 6000),
               _entry({"W1": _result(2.5, 800.0)}, 2000)]  # medians, not means
    merged = merge_rounds(entries)
    assert merged["rounds"] == entries and merged["log"] == ["a.log"] * 4
    assert merged["error"] == "exited with status 1" and merged["model"] == "m"
    assert merged["startup_s"] == 4.0 and merged["rss_bytes"] == 2000
    w1, w5 = merged["workloads"]["W1"], merged["workloads"]["W5"]
    assert w1["rounds"] == 3 and w5["rounds"] == 2
    assert w1["output_tok_s"] == 2.5 and w1["output_tok_s_range"] == [2.0, 3.5]
    assert w1["ttft_p50_ms"] == 400.0 and w1["ttft_p50_ms_range"] == [300.0, 800.0]
    assert w1["wall_s"] == 128 / 2.5 and w1["prompt_tokens"] == [520, 520, 520]
    assert w5["output_tok_s"] == 70.0  # the median of two: their mean
    assert w5["ttft_p50_ms"] == 410.0 and w5["ttft_p50_ms_range"] == [410.0, 410.0]
    assert w5["output_tokens"] == 100 and w5["errors"] == ["cut"]  # the shortfall shows
    assert w5["itl_p50_ms"] is None and w5["expected_tokens"] == 128
    assert merge_rounds(entries[:1]) is entries[0]  # one round: as it is


def test_the_table_shows_the_rounds_range() -> None:
    bench_peers = _bench_peers()
    merged = bench_peers.merge_rounds([_entry({"W1": _result(2.0, 400.0)}, 10**9),
                                       _entry({"W1": _result(3.0, 300.0)}, 10**9)])
    text = bench_peers.table([merged])
    assert "2.5 (2.0-3.0)" in text and "350.0 (300.0-400.0)" in text
    assert "medians of 2 rounds" in text
    assert "medians" not in bench_peers.table([_entry({"W1": _result(2.0, 400.0)}, 10**9)])


def test_rounds_start_the_servers_in_turn(tmp_path) -> None:
    out = tmp_path / "peers.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--server", "one=false {port}",
         "--server", "two=false {port} x", "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    order = [line.split("]")[0] for line in result.stderr.splitlines()
             if line.startswith(("[", "round"))]
    assert order == ["round 1 of 2", "[one", "[two", "round 2 of 2", "[one", "[two"]
    report = json.loads(out.read_text())
    assert report["config"]["rounds"] == 2
    assert [len(s["rounds"]) for s in report["servers"]] == [2, 2]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--server", "one=false {port}",
                          "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--server", "one=false {port}",
                          "--prefill-repeat", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--prefill-repeat must be >= 1" in bad.stderr
