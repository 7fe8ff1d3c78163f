"""Real server: models, tokenize/detokenize, version, metrics deltas, disconnect aborts
(KV blocks back in the pool), CORS, request ids, logs without prompt text."""

from __future__ import annotations

import uuid

import httpx
import pytest
from helpers.server import MODEL, RemoteServer, wait_for

import plait


def test_models_version_tokenize_detokenize(server: RemoteServer) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "plait" and models.data[0].object == "model"
    assert server.openai().models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/version").json() == {"version": plait.__version__}
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
        assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}
                         ).json() == {"prompt": "Hello world"}
        chat = http.post("/tokenize", json={"model": MODEL, "messages": [
            {"role": "user", "content": "Hello world"}]}).json()
        assert chat["count"] > tokens["count"]
        assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()[
            "prompt"].endswith("<|im_start|>assistant\n")
        bad = http.post("/detokenize", json={"model": MODEL, "tokens": [1, 10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_metrics_move_by_exactly_the_request(server: RemoteServer) -> None:
    prompt = f"{uuid.uuid4().hex} metrics probe"
    num_prompt = len(server.http().post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    before = server.metrics()
    result = server.openai().completions.create(
        model=MODEL, prompt=prompt, n=2, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 8
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("plait_generation_tokens_total") == 8
    assert moved("plait_prompt_tokens_computed_total") == num_prompt  # prefilled once
    assert moved("plait_prompt_tokens_cached_total") == num_prompt  # the second choice
    assert moved('plait_request_success_total{finish_reason="length"}') == 2
    assert moved('plait_request_success_total{finish_reason="stop"}') == 0
    assert moved("plait_request_n_count") == 1 and moved("plait_request_n_sum") == 2
    assert moved("plait_time_to_first_token_seconds_count") == 2
    assert moved("plait_inter_token_latency_seconds_count") == 6
    assert moved("plait_e2e_request_latency_seconds_count") == 1
    assert moved("plait_num_preemptions_total") == 0
    assert after["plait_num_requests_running"] == 0
    assert after["plait_num_requests_waiting"] == 0
    assert after["plait_kv_cache_usage_perc"] == 0  # nothing held at rest


def test_stream_disconnect_aborts_all_choices_and_frees_their_blocks(server) -> None:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} Once upon a time,",
            "max_tokens": 1, "temperature": 1.0}
    with server.http() as http:  # the identical prompt, finished: a kept prompt now
        assert http.post("/v1/completions", json=body).status_code == 200
        server.assert_at_rest()
        generated = server.metrics()["plait_generation_tokens_total"]
        # Far more tokens than can be generated before the disconnect, on any machine.
        long_body = {**body, "n": 3, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long_body) as response:
            # Keep the line iterator alive: dropping a half-read httpx iterator closes the
            # connection, which is the disconnect this test wants to make only later.
            lines = response.iter_lines()
            num_chunks = 0
            while num_chunks < 6:
                num_chunks += next(lines).startswith("data: {")
            assert wait_for(lambda: server.metrics()["plait_num_requests_running"] == 3, 30)
            assert server.metrics()["plait_kv_blocks_used"] > 0
            response.close()  # the client hangs up mid-stream
        assert wait_for(lambda: server.metrics()["plait_num_requests_running"] == 0, 30)
    server.assert_at_rest()  # no KV block in use
    assert server.metrics()["plait_generation_tokens_total"] - generated < 3 * 4000


def test_non_streaming_disconnect_aborts(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "n": 2, "max_tokens": 4000,
            "ignore_eos": True}
    generated = server.metrics()["plait_generation_tokens_total"]
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    # Running and generated tokens come in one stats snapshot: once no choice runs, the
    # count is final.
    assert wait_for(lambda: server.metrics()["plait_num_requests_running"] == 0, 30)
    assert server.metrics()["plait_generation_tokens_total"] - generated < 2 * 4000


def test_cors_preflight_and_simple_request(server: RemoteServer) -> None:
    origin = {"Origin": "https://ui.example"}
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    simple = httpx.get(f"{server.url}/v1/models", headers={**origin, **server.headers})
    assert simple.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in simple.headers["access-control-expose-headers"].lower()


def test_request_ids_and_logs_without_prompt_text(server: RemoteServer) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    with server.http() as http:
        response = http.post("/v1/chat/completions", headers={"x-request-id": "trace-7"},
                             json={"model": MODEL, "max_tokens": 2, "messages": [
                                 {"role": "user", "content": f"Repeat {secret}"}]})
    assert response.headers["x-request-id"] == "trace-7"
    completion_id = response.json()["id"]
    assert wait_for(lambda: completion_id in server.log(), 30)
    log = server.log()
    line = next(ln for ln in log.splitlines() if completion_id in ln)
    assert "trace-7" in line and "prompt_tokens=" in line and "e2e=" in line
    assert secret not in log
