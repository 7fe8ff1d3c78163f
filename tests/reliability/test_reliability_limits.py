"""Limits of a real server (the reliability server: 4 running slots, 8 queued, 64 KiB bodies,
64-token context): body size (413), logit_bias entries, max_tokens past the context,
admission control (503 + Retry-After, n admitted or refused whole), queued disconnects,
API key from a file, --log-prompts; plus the CLI defaults of these options."""

from __future__ import annotations

import asyncio
import http.client
import json
import uuid

import httpx
import pytest
from helpers.server import (
    API_KEY,
    MODEL,
    RELIABILITY,
    RemoteServer,
    error_of,
    parse_sse,
    reliability_server,
    wait_for,
)

from plait.cli import build_parser, server_settings

CAPACITY = RELIABILITY["max_num_seqs"] + RELIABILITY["max_queued_requests"]


@pytest.fixture(scope="module")
def server() -> RemoteServer:
    return reliability_server()


def test_cli_defaults_and_environment() -> None:
    settings = server_settings(build_parser({}).parse_args(["serve"]))
    assert settings.max_request_bytes == 10 * 1024 * 1024
    assert settings.max_queued_requests == 256
    assert (settings.log_prompts, settings.fault_injection, settings.host) == \
        (False, False, "127.0.0.1")
    env = {"PLAIT_MAX_QUEUED_REQUESTS": "3", "PLAIT_MAX_REQUEST_BYTES": "100",
           "PLAIT_LOG_PROMPTS": "true", "PLAIT_FAULT_INJECTION": "1"}
    settings = server_settings(build_parser(env).parse_args(["serve"]))
    assert (settings.max_queued_requests, settings.max_request_bytes) == (3, 100)
    assert settings.log_prompts and settings.fault_injection
    serve = build_parser({})._subparsers._group_actions[0].choices["serve"]  # type: ignore
    assert "fault-injection" not in serve.format_help()  # test-only: hidden


def _post_raw(server: RemoteServer, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
    """POST with exactly these headers and bytes (the body may be shorter than announced)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for key, value in {**server.headers, **headers}.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_body_size_is_checked_up_front_and_while_reading(server: RemoteServer) -> None:
    limit = RELIABILITY["max_request_bytes"]
    # Content-Length announces 1 GB and 1 byte follows: the answer comes without the body.
    status, body = _post_raw(server, {"Content-Type": "application/json",
                                      "Content-Length": str(10**9)}, b"{")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error" and str(limit) in \
        body["error"]["message"]
    padded = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}]}

    def chunks(payload: dict, pad: int):
        data = json.dumps({**payload, "user": "x" * pad}).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    json_type = {"Content-Type": "application/json"}
    with server.http() as http:  # chunked bodies: no Content-Length at all
        small = http.post("/v1/chat/completions", content=chunks(padded, 40_000),
                          headers=json_type)
        assert small.status_code == 200, small.text
        big = http.post("/v1/chat/completions", content=chunks(padded, limit),
                        headers=json_type)
        error = error_of(big, 413)
        assert error["code"] == "request_too_large" and big.headers["x-request-id"]
        plain = http.post("/v1/chat/completions", json={**padded, "user": "x" * limit})
        assert error_of(plain, 413)["code"] == "request_too_large"
        assert http.get("/health").status_code == 200


def test_a_body_not_sent_as_json_gets_a_clear_400(server: RemoteServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    with server.http() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Content-Type": "text/plain"})
    assert "Content-Type: application/json" in error_of(response, 400)["message"]


def test_logit_bias_is_limited_to_300_entries(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with server.http() as http:
        ok = http.post("/v1/completions", json={
            **body, "logit_bias": {str(i): 0 for i in range(300)}})
        assert ok.status_code == 200, ok.text
        error = error_of(http.post("/v1/completions", json={
            **body, "logit_bias": {str(i): 0 for i in range(301)}}), 400)
    assert (error["param"], error["code"]) == ("logit_bias", "invalid_value")
    assert "at most 300" in error["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("prompt", [1, 49152]), ("stop_token_ids", [49152]), ("stop_token_ids", [-1]),
    ("logit_bias", {"49152": 1})])
def test_token_ids_outside_the_vocabulary_are_400s_naming_the_parameter(
        server: RemoteServer, field: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, field: value}
    with server.http() as http:
        error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["param"] == field and "vocabulary" in error["message"]


async def _complete(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, dict]:
    """(finish_reason, usage) of a streamed or plain request."""
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        data = response.json()
        return data["choices"][0]["finish_reason"], data["usage"]
    sse = parse_sse(response.content)
    assert sse.events[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in sse.chunks if c["choices"]]
    return next(f for f in finishes if f), sse.chunks[-1]["usage"]


async def test_max_tokens_past_the_context_is_clamped_to_it(server: RemoteServer) -> None:
    context = RELIABILITY["max_model_len"]
    base = {"model": MODEL, "max_tokens": 10_000, "ignore_eos": True}
    chat = {**base, "messages": [{"role": "user", "content": "Count."}]}
    completion = {**base, "prompt": "1, 2, 3,"}
    usage = {"stream_options": {"include_usage": True}, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=120) as client:
        results = await asyncio.gather(
            _complete(client, "/v1/chat/completions", chat),
            _complete(client, "/v1/chat/completions", {**chat, **usage}),
            _complete(client, "/v1/completions", completion),
            _complete(client, "/v1/completions", {**completion, **usage}))
    for finish_reason, counts in results:
        assert finish_reason == "length"
        assert counts["prompt_tokens"] + counts["completion_tokens"] == context


def _long(n: int, tag: str) -> dict:
    return {"model": MODEL, "prompt": f"{tag}: tell a story.", "n": n,
            "max_tokens": 10_000, "ignore_eos": True, "stream": True}


async def _hold(client: httpx.AsyncClient, body: dict) -> None:
    """Keep a stream open (reading it) until cancelled."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            pass


async def _cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_overload_is_503_and_n_is_admitted_or_refused_whole(server) -> None:
    refused = 'plait_requests_refused_total{reason="overloaded"}'
    before = server.metrics()[refused]
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=60) as client:
        held = [asyncio.create_task(_hold(client, _long(4, "a"))),
                asyncio.create_task(_hold(client, _long(CAPACITY - 5, "b")))]
        try:
            assert await asyncio.to_thread(
                wait_for, lambda: server.gauges() == (4, CAPACITY - 5), 30), server.gauges()
            over = await client.post("/v1/completions", json=_long(2, "d"))  # 13 > 12
            error = error_of(over, 503)
            assert (error["type"], error["code"]) == ("server_error", "overloaded")
            assert "overloaded" in error["message"] and over.headers["retry-after"] == "1"
            assert server.gauges() == (4, CAPACITY - 5)  # nothing of it was admitted
            never = error_of(await client.post("/v1/completions",
                                               json=_long(CAPACITY + 1, "d")), 400)
            assert (never["param"], never["code"]) == ("n", "too_many_sequences")
            never = error_of(await client.post("/v1/completions", json={
                **_long(1, "d"), "stream": False, "best_of": CAPACITY + 1}), 400)
            assert (never["param"], never["code"]) == ("best_of", "too_many_sequences")
            held.append(asyncio.create_task(_hold(client, _long(1, "c"))))  # fills it
            assert await asyncio.to_thread(
                wait_for, lambda: server.gauges() == (4, CAPACITY - 4), 30)
            error_of(await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}), 503)
            assert server.metrics()[refused] - before == 2
        finally:
            await _cancel(*held)
    server.assert_at_rest()
    with server.http() as http:
        assert http.post("/v1/completions", json={**_long(1, "a"), "stream": False,
                                                  "max_tokens": 2}).status_code == 200


async def test_disconnect_while_queued_aborts_every_choice(server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                 timeout=60) as client:
        running = asyncio.create_task(_hold(client, _long(4, "e")))
        try:
            assert await asyncio.to_thread(wait_for, lambda: server.gauges() == (4, 0), 30)
            queued = asyncio.create_task(_hold(client, _long(3, "f")))
            assert await asyncio.to_thread(wait_for, lambda: server.gauges() == (4, 3), 30)
            await _cancel(queued)  # before its first token: it never left the queue
            assert await asyncio.to_thread(wait_for, lambda: server.gauges() == (4, 0), 10)
        finally:
            await _cancel(running)
    server.assert_at_rest()


def test_api_key_from_a_file_and_prompt_logging(server: RemoteServer) -> None:
    secret = f"logged-{uuid.uuid4().hex}"
    body = {"model": MODEL, "prompt": f"Say {secret}", "max_tokens": 1}
    assert error_of(httpx.post(f"{server.url}/v1/completions", json=body), 401)
    response = httpx.post(f"{server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    completion_id = response.json()["id"]
    assert wait_for(lambda: secret in server.log() and completion_id in server.log(), 30)
    line = next(ln for ln in server.log().splitlines() if secret in ln)
    assert "prompt 0:" in line and response.headers["x-request-id"] in line
