"""`plait serve --speculative-config` (ngram) on the default model, against the same server
without it (both in the default numerics, the int8 mode, where speculation is exact; the
session's shared server runs the exact mode): greedy answers (plain, streamed with
logprobs, with tools) are the same, a streamed chunk may carry several tokens, usage counts
every token, and /metrics has vLLM's spec_decode series."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import API_KEY, MODEL, RemoteServer, start_server
from prometheus_client.parser import text_string_to_metric_families

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5})
TEXT = ("def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n    if width < 0 "
        "or height < 0:\n        raise ValueError(\"negative size\")\n    return width * "
        "height\n")
# SmolLM2 answers this with the code again, renamed: ngram drafts are accepted
REPEAT = [{"role": "user", "content": "Rename the function to rect_area in this code and "
           f"output the whole code:\n\n```python\n{TEXT}```"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _serve(args: list[str]) -> Iterator[RemoteServer]:
    # the engine in the server's process: a spawned engine process imports `plait` from
    # the installed distribution, which need not be this checkout (the config's crossing
    # of the process pipe is tests/unit/test_spec_wire.py's)
    server = start_server([*args, "--no-engine-process"], api_key=API_KEY,
                          env={"PLAIT_API_KEY": API_KEY})
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def spec_server() -> Iterator[RemoteServer]:
    yield from _serve(["--speculative-config", NGRAM])


@pytest.fixture(scope="module")
def plain() -> Iterator[RemoteServer]:
    yield from _serve([])


def chat(server: RemoteServer, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers,
                          json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: RemoteServer, **body) -> list[dict]:
    body = {"model": MODEL, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=server.headers,
                      json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_greedy_answers_equal_and_metrics(spec_server: RemoteServer,
                                          plain: RemoteServer) -> None:
    for body in (dict(messages=REPEAT, max_tokens=96),
                 dict(messages=[{"role": "user", "content": "What is the weather in Rome?"}],
                      tools=[WEATHER], max_tokens=60)):
        want, got = chat(plain, **body), chat(spec_server, **body)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        # cached_tokens is the prefix cache's state, not speculation's: the token counts
        # must be equal
        usage = lambda response: {k: v for k, v in response["usage"].items()  # noqa: E731
                                  if k != "prompt_tokens_details"}
        assert usage(got) == usage(want)
    chunks = stream(spec_server, messages=REPEAT, max_tokens=96, logprobs=True,
                    top_logprobs=2)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    tokens = [t for c in content for t in c["choices"][0]["logprobs"]["content"]]
    want = chat(plain, messages=REPEAT, max_tokens=96, logprobs=True, top_logprobs=2)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content) == \
        want["choices"][0]["message"]["content"]
    assert [t["token"] for t in tokens] == \
        [t["token"] for t in want["choices"][0]["logprobs"]["content"]]
    assert chunks[-1]["usage"]["completion_tokens"] == len(tokens) == \
        want["usage"]["completion_tokens"]
    # without logprobs a step's tokens go out as one chunk: vLLM's return_token_ids shows
    # them (with logprobs, the stream has a chunk per token, as without speculation)
    chunks = stream(spec_server, messages=REPEAT, max_tokens=96, return_token_ids=True)
    steps = [c["choices"][0]["token_ids"] for c in chunks
             if c["choices"] and c["choices"][0].get("token_ids")]
    assert max(len(ids) for ids in steps) > 1
    assert sum(len(ids) for ids in steps) == chunks[-1]["usage"]["completion_tokens"] == \
        want["usage"]["completion_tokens"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == want["choices"][0]["message"]["content"]
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{spec_server.url}/metrics", timeout=30).text)}
    labels = {"model_name": MODEL, "engine": "0"}
    values = {name: [(s.labels, s.value) for s in families[name].samples
                     if s.name.endswith("_total")]
              for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                           "vllm:spec_decode_num_accepted_tokens",
                           "vllm:spec_decode_num_accepted_tokens_per_pos")}
    (drafts,) = values["vllm:spec_decode_num_drafts"]
    (draft_tokens,) = values["vllm:spec_decode_num_draft_tokens"]
    (accepted,) = values["vllm:spec_decode_num_accepted_tokens"]
    assert drafts[0] == draft_tokens[0] == accepted[0] == labels
    assert 0 < accepted[1] <= draft_tokens[1] and drafts[1] > 0
    per_pos = values["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert [lab for lab, _ in per_pos] == [{**labels, "position": str(i)} for i in range(4)]
    assert sum(v for _, v in per_pos) == accepted[1]
    assert [v for _, v in per_pos] == sorted((v for _, v in per_pos), reverse=True)
    assert "vllm:spec_decode_num_drafts" not in httpx.get(f"{plain.url}/metrics",
                                                         timeout=30).text


def test_a_draft_model_that_does_not_load_is_a_startup_error(tmp_path) -> None:
    # every method has its proposer in this build: a draft model that cannot be loaded
    # fails the start as a bad model path does (exit 1, one line naming it)
    missing = tmp_path / "draft.gguf"
    server = start_server(["--speculative-config",
                           json.dumps({"method": "draft_model", "model": str(missing)})])
    assert server.process.wait(timeout=300) == 1
    log = server.log()
    assert "cannot load the model" in log and str(missing) in log
