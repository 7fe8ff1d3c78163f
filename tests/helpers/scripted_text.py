"""Scripted model output for parser tests: `TextCore` writes given texts token by token
through the real engine, HTTP app and stream code (tests/helpers/scripted.py's core), and
`scripted_client` serves it with given `ServerSettings`.

    with scripted_client(TextCore(tokenizer, ["<think>a</think>b"]), settings) as http:
        http.post("/v1/chat/completions", json=...)      sub-request k writes scripts[k]
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import InProcessServer, parse_sse, wait_for
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.server.app import create_app
from plait.server.settings import ServerSettings


class TextCore(ScriptedCore):
    """Sub-request k (in the order they are added) writes `scripts[k % len]` token by token
    and finishes with "stop" (or "length" at its max_tokens). `prompts` and `params` record
    each sub-request's prompt token ids and sampling parameters."""

    def __init__(self, tokenizer, scripts: list[str]) -> None:
        super().__init__(tokenizer)
        self.scripts = [tokenizer.encode(s, add_special_tokens=False) for s in scripts]
        self.tokens: dict[str, list[int]] = {}
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        super().add_request(request_id, prompt_token_ids, params)
        with self.lock:
            self.tokens[request_id] = self.scripts[len(self.tokens) % len(self.scripts)]
            self.prompts.append(list(prompt_token_ids))
            self.params.append(params)

    def next_delta(self, request_id: str, params: SamplingParams, done: int) -> RequestDelta:
        script = self.tokens[request_id]
        token = script[done]
        delta = RequestDelta(request_id, [token], self.tokenizer.decode([token]),
                             num_prompt_tokens=3)
        if done + 1 == len(script):
            delta.finish_reason = "stop"
        elif done + 1 >= (params.max_tokens or 64):
            delta.finish_reason = "length"
        return delta


@contextmanager
def scripted_client(core: TextCore,
                    settings: ServerSettings | None = None) -> Iterator[httpx.Client]:
    """An HTTP client of a real app around `core`, once /health is 200."""
    app = create_app(settings or ServerSettings(), engine=scripted_engine(core))
    with InProcessServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        yield http


def stream_chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON chunks of `body` streamed from `path` (200 asserted)."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        raw = b"".join(response.iter_bytes())
    return parse_sse(raw).chunks


def accumulate(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index, what its deltas add up to (as the openai SDK accumulates them):
    content, reasoning_content, reasoning, tool_calls (functions; ids checked and dropped;
    a call's later pieces, without an id, add to its arguments) and finish_reason. Fields
    never sent stay None."""
    result: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            entry = result.setdefault(choice["index"], {
                "content": None, "reasoning_content": None, "reasoning": None,
                "tool_calls": [], "finish_reason": None})
            delta = choice["delta"]
            for key in ("content", "reasoning_content", "reasoning"):
                if delta.get(key):
                    entry[key] = (entry[key] or "") + delta[key]
            for call in delta.get("tool_calls", []):
                calls = entry["tool_calls"]
                if call["index"] == len(calls) - 1 and "id" not in call:
                    # a later piece of the last call (its arguments, streamed on)
                    calls[-1]["arguments"] += call["function"].get("arguments", "")
                    continue
                assert call["index"] == len(calls)
                assert is_call_id(call.pop("id")) and call.pop("type") == "function"
                calls.append(call["function"])
            entry["finish_reason"] = choice["finish_reason"] or entry["finish_reason"]
    return result


def is_call_id(call_id: str) -> bool:
    """OpenAI's form (call_ + 24 hex digits) or, under a Mistral template, 9 letters and
    digits (output_reader.new_call_id)."""
    return re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", call_id) is not None


def whole_choices(response: dict) -> dict[int, dict]:
    """Per choice index, the same fields of a non-streamed response's message."""
    result = {}
    for choice in response["choices"]:
        message = choice["message"]
        calls = message.get("tool_calls") or []
        assert all(is_call_id(c.pop("id")) for c in calls)
        result[choice["index"]] = {
            "content": message["content"],
            "reasoning_content": message.get("reasoning_content"),
            "reasoning": message.get("reasoning"),
            "tool_calls": [c["function"] for c in calls],
            "finish_reason": choice["finish_reason"]}
    return result


def dumps(value: object) -> str:
    """Compact JSON, as tool-call arguments are compared."""
    return json.dumps(value, separators=(",", ":"))
