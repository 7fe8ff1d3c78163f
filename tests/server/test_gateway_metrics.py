"""The model-server metrics protocol on a real server: the `vllm:` series that the inference
gateway's endpoint picker (llm-d-router `docs/plugin-metric-protocol.md`, its vLLM engine
config) and the vLLM production-stack router scrape, with vLLM's names, types and labels;
their values while requests run, at rest, and for a repeated prompt."""

from __future__ import annotations

import re
import uuid

import httpx
from helpers.server import MODEL, RemoteServer, wait_for
from prometheus_client.parser import text_string_to_metric_families

from plait.engine.config import EngineConfig
from plait.engine.core_api import EngineStats
from plait.engine.model_loader import default_gguf_path
from plait.server.metrics import EngineIdentity, ServerMetrics

LABELS = {"model_name": MODEL, "engine": "0"}
# The picker's vLLM mapping (queue, running, KV usage, cache info) and the production-stack
# router's names; every one is vLLM's.
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits")


def scrape(server: RemoteServer) -> dict[str, tuple[str, list]]:
    """/metrics without an API key, parsed: family name -> (type, samples)."""
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200
    return {f.name: (f.type, f.samples)
            for f in text_string_to_metric_families(response.text)}


def value(families: dict[str, tuple[str, list]], name: str) -> float:
    """The one sample of family `name` (a `vllm:` one carries exactly LABELS)."""
    _, samples = families[name]
    values = [s.value for s in samples if not s.name.endswith("_created")]
    assert len(values) == 1, samples
    return values[0]


def test_protocol_names_types_and_labels(server: RemoteServer) -> None:
    families = scrape(server)
    for name in GAUGES:
        kind, samples = families[name]
        assert kind == "gauge", name
        assert [(s.name, s.labels) for s in samples] == [(name, LABELS)]
    for name in COUNTERS:  # prometheus_client's counters end in _total, as vLLM's do
        kind, samples = families[name]
        assert kind == "counter", name
        assert [(s.name, s.labels) for s in samples] == [(f"{name}_total", LABELS)]
    kind, samples = families["vllm:cache_config_info"]
    assert kind == "gauge" and len(samples) == 1 and samples[0].value == 1
    # The engine's own account of its pool, from its "ready:" log line.
    logged = re.search(r"dtype (\w+), (\d+) KV blocks,", server.log())
    assert logged is not None
    assert logged.group(2) == str(int(value(families, "plait_kv_blocks_total")))
    assert samples[0].labels == {
        "block_size": str(EngineConfig().block_size), "cache_dtype": logged.group(1),
        "enable_prefix_caching": "True", "engine": "0", "num_gpu_blocks": logged.group(2)}
    for name in ("plait_num_requests_running", "plait_kv_cache_usage_perc",
                 "plait_prefix_cache_hits"):  # Plait's own names are still there
        assert name in families


def test_weight_bytes_are_the_files_size(server: RemoteServer) -> None:
    """The default model's weights stay in its GGUF's blocks (Q4_1, a Q8_0 embedding shared
    by the head): what the gauge reports is the file's tensors, not a float32 inflation."""
    weights = value(scrape(server), "plait_model_weight_bytes")
    size = default_gguf_path().stat().st_size
    assert 0.9 * size < weights <= 1.1 * size, (weights, size)


def test_running_counts_sub_requests_and_everything_rests_at_zero(server) -> None:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} Once upon a time,", "n": 4,
            "max_tokens": 4000, "ignore_eos": True, "temperature": 1.0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept alive: dropping it would disconnect now
        num_chunks = 0
        while num_chunks < 8:
            num_chunks += next(lines).startswith("data: {")
        # One HTTP request with n=4 is four engine sub-requests, as vLLM counts n's children.
        assert wait_for(lambda: value(scrape(server), "vllm:num_requests_running") == 4, 10)
        families = scrape(server)
        assert value(families, "vllm:num_requests_waiting") == 0
        usage = value(families, "vllm:kv_cache_usage_perc")
        assert 0 < usage <= 1
        assert value(families, "vllm:gpu_cache_usage_perc") == usage
        assert value(families, "plait_kv_cache_usage_perc") == usage
        assert value(families, "plait_num_requests_running") == 4
        response.close()
    server.assert_at_rest()
    families = scrape(server)
    for name in GAUGES:
        assert value(families, name) == 0, name


def test_prefix_cache_counters_count_a_repeated_prompt(server: RemoteServer) -> None:
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 8
    with server.http() as http:
        num_prompt = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    block_size = EngineConfig().block_size
    assert num_prompt > 4 * block_size
    counts, cached = [], []
    for _ in range(2):
        families = scrape(server)
        counts.append((value(families, "vllm:prefix_cache_queries"),
                       value(families, "vllm:prefix_cache_hits")))
        assert counts[-1] == (value(families, "plait_prefix_cache_queries"),
                              value(families, "plait_prefix_cache_hits"))
        assert counts[-1] == (value(families, "vllm:gpu_prefix_cache_queries"),
                              value(families, "vllm:gpu_prefix_cache_hits"))
        result = server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        cached.append(result.usage.prompt_tokens_details.cached_tokens)
    families = scrape(server)
    after = (value(families, "vllm:prefix_cache_queries"),
             value(families, "vllm:prefix_cache_hits"))
    first = (counts[1][0] - counts[0][0], counts[1][1] - counts[0][1])
    second = (after[0] - counts[1][0], after[1] - counts[1][1])
    assert first == (num_prompt, 0) and cached[0] == 0
    assert second == (num_prompt, cached[1])  # hits: exactly what the request reports
    assert cached[1] >= (num_prompt - 1) // block_size * block_size > 0


def test_nothing_of_the_engine_before_it_loads() -> None:
    metrics = ServerMetrics(lambda: None, lambda: EngineIdentity(MODEL, 16, 8, "float32", True))
    text = metrics.render().decode()
    assert "vllm:" not in text and "plait_num_requests_running" not in text


def test_model_name_label_is_escaped() -> None:
    name = 'a "quoted"\\name'
    stats = EngineStats(num_running=2, num_waiting=1, kv_blocks_used=25, kv_blocks_total=100,
                        prefix_cache_queries=40, prefix_cache_hits=32)
    metrics = ServerMetrics(lambda: stats, lambda: EngineIdentity(name, 32, 100, "bfloat16",
                                                                  False))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["vllm:num_requests_running"].samples[0].labels["model_name"] == name
    assert [s.value for s in families["vllm:num_requests_waiting"].samples] == [1]
    assert [s.value for s in families["vllm:prefix_cache_hits"].samples] == [32]
    assert families["vllm:cache_config_info"].samples[0].labels == {
        "block_size": "32", "cache_dtype": "bfloat16", "enable_prefix_caching": "False",
        "engine": "0", "num_gpu_blocks": "100"}
