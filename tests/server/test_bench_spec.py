"""The text workloads (W6 edit, W7 quote: plait/bench/texts.py) in `plait bench` and
scripts/bench_peers.py, and the speculative decoding counters read from /metrics
(plait/bench/spec_metrics.py)."""

from __future__ import annotations

import asyncio
import inspect
import statistics
import sys

import pytest
from helpers.paths import SCRIPTS

from plait.bench.cli import add_parser, resolve
from plait.bench.client import CHAT, StreamResult
from plait.bench.spec_metrics import SpecCounters, parse_spec_counters, spec_delta
from plait.bench.texts import EDIT_MAX_TOKENS, edit_prompt, quote_prompt, text_prompt
from plait.bench.workloads import build_requests

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m"} 12.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 48.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 11.0
vllm:spec_decode_num_drafts_created 1.7e9
plait_prompt_tokens_computed_total 512.0
"""


def test_spec_counters_from_a_prometheus_exposition() -> None:
    counters = parse_spec_counters(METRICS)
    assert counters == SpecCounters(drafts=12.0, draft_tokens=48.0, accepted_tokens=30.0)
    assert counters.acceptance_rate == 0.625 and counters.mean_acceptance_length == 3.5
    assert counters.describe() == ("12 drafts, 48 draft tokens, 30 accepted (62.5%), "
                                   "mean acceptance length 3.50")
    assert parse_spec_counters("plait_prompt_tokens_computed_total 5\n") is None
    # llama-server --metrics: the same names under its own prefix, no labels
    llama = ("llamacpp:spec_decode_num_draft_tokens_total 40\n"
             "llamacpp:spec_decode_num_accepted_tokens_total 10\n"
             "llamacpp:spec_decode_num_drafts_total 10\n"
             "other:spec_decode_num_drafts_total 99\n")
    assert parse_spec_counters(llama) == SpecCounters(10.0, 40.0, 10.0)
    before = SpecCounters(2.0, 8.0, 6.0)
    assert spec_delta(before, counters) == SpecCounters(10.0, 40.0, 24.0)
    assert spec_delta(None, counters) is None
    assert SpecCounters(0.0, 0.0, 0.0).describe() == "0 drafts, 0 draft tokens, 0 accepted"


def test_the_edit_text_is_a_stdlib_function_of_300_to_500_tokens(tokenizer) -> None:
    prompt = edit_prompt()
    code = inspect.getsource(statistics.quantiles)
    (message,) = prompt.messages
    assert message["role"] == "user" and code in message["content"]
    assert 300 <= len(tokenizer.encode(code)) <= 500
    assert prompt.max_tokens == EDIT_MAX_TOKENS and prompt.source.startswith(
        "statistics.quantiles, Python 3.")


def test_the_quote_text_is_a_long_reference_section(tokenizer) -> None:
    from pydoc_data.topics import topics

    prompt = quote_prompt()
    assert topics["naming"].strip() in prompt.messages[0]["content"]
    assert len(tokenizer.encode(prompt.messages[0]["content"])) > 1200
    with pytest.raises(ValueError, match="unknown text workload 'poem'"):
        text_prompt("poem")


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_plait_bench_text_kinds_default_to_greedy_chat_without_ignore_eos() -> None:
    args = parse("--workload", "edit")
    workload, dataset = resolve(args)
    assert (args.endpoint, args.temperature, args.ignore_eos) == (CHAT, 0.0, False)
    assert (workload.num_requests, workload.output_len, dataset) == (1, None, None)
    specs, counts = asyncio.run(build_requests(workload, None))
    assert [(s.messages, s.max_tokens, s.n) for s in specs] == [
        (edit_prompt().messages, EDIT_MAX_TOKENS, 1)]
    assert counts == [None]
    args = parse("--workload", "quote", "--num-requests", "2", "--output-len", "9",
                 "--temperature", "0.5")
    workload, _ = resolve(args)
    specs, _ = asyncio.run(build_requests(workload, None))
    assert [(s.max_tokens, args.temperature) for s in specs] == [(9, 0.5), (9, 0.5)]
    args = parse("--workload", "random")
    resolve(args)
    assert (args.endpoint, args.temperature, args.ignore_eos) == (
        "/v1/completions", 1.0, True)
    with pytest.raises(ValueError, match="--workload edit is a chat workload"):
        resolve(parse("--workload", "edit", "--endpoint", "/v1/completions"))


def _bench_peers():
    sys.path.insert(0, str(SCRIPTS))
    import bench_peers

    return bench_peers


def test_bench_peers_w6_w7_are_greedy_chat_on_the_texts() -> None:
    bench_peers = _bench_peers()
    args = bench_peers.parse_args(["--server", "a=serve {port}", "--workloads", "w6,W7"])
    assert args.workloads == ["W6", "W7"]
    for name, prompt in (("W6", edit_prompt()), ("W7", quote_prompt())):
        endpoint, bodies = bench_peers.workload_bodies("m", name, args)
        assert endpoint == CHAT
        assert bodies == [{"model": "m", "messages": prompt.messages, "temperature": 0.0,
                           "max_tokens": prompt.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}]


def test_decode_tok_s_counts_tokens_after_the_first_chunk() -> None:
    decode_tok_s = _bench_peers().decode_tok_s
    # 9 tokens in 4 chunks (speculation delivers several at once): 8 after the first, in 2 s
    one = StreamResult(token_times={0: [1.0, 1.5, 2.5, 3.0]}, completion_tokens=9)
    assert decode_tok_s([one]) == 4.0
    assert decode_tok_s([StreamResult(token_times={0: [1.0]}, completion_tokens=1)]) is None


def test_the_table_shows_accepted_draft_tokens() -> None:
    bench_peers = _bench_peers()
    result = {"requests": 1, "n": 1, "max_tokens": 640, "expected_tokens": 640,
              "output_tokens": 500, "wall_s": 5.0, "output_tok_s": 100.0,
              "decode_tok_s": 120.0, "ttft_p50_ms": 800.0, "ttft_p99_ms": 800.0,
              "itl_p50_ms": None, "itl_p99_ms": None, "prompt_tokens": [560],
              "prompt_tokens_computed": 560.0, "spec_drafts": 100.0,
              "spec_draft_tokens": 400.0, "spec_accepted_tokens": 300.0,
              "acceptance_rate": 0.75, "errors": []}
    server = {"name": "plait-ngram", "error": None, "workloads": {"W6": result},
              "rss_bytes": None}
    text = bench_peers.table([server])
    assert "300/400 (75.0%)" in text and "120.0" in text
    assert "W6/W7 tokens = output/max_tokens: greedy, ended by the model" in text
