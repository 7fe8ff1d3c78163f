"""`plait serve` with no flags on the default GGUF: the int8 numerics (weights repacked at
their own bit width) where the CPU has AVX512-VNNI, said once in the log; the weights held
at the file's size; the API answering as in the exact mode's modules (which share an
`--exact` server: tests/helpers/server.py)."""

from __future__ import annotations

import pytest
from helpers.server import MODEL, RemoteServer, start_server

from plait.engine.model_loader import default_gguf_path
from plait.kernels.cpu import build, repack

pytestmark = pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                                reason="no AVX512-VNNI repacked kernel: the default is exact")


@pytest.fixture(scope="module")
def server():
    server = start_server([], {"PLAIT_LOG_LEVEL": "info"})
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_the_default_is_int8_and_says_so(server: RemoteServer) -> None:
    log = server.log()
    numerics = [line for line in log.splitlines() if "numerics: " in line]
    assert len(numerics) == 1, numerics
    assert "numerics: int8 (auto: a GGUF file on a CPU with AVX512-VNNI)" in numerics[0]
    assert f"products: repacked/{repack.ISA_NAMES[repack.isa()]} for 121 linears" in log
    weights = server.metrics()["plait_model_weight_bytes"]
    file_bytes = default_gguf_path().stat().st_size
    assert 0.9 * file_bytes < weights <= 1.05 * file_bytes


def test_n_choices_stream_and_whole_agree(server: RemoteServer) -> None:
    """Greedy n=2 choices of one prompt are the same text, streamed or not (the second
    request finds the first's prompt cached: its logits are reused, not recomputed)."""
    client = server.openai()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                  n=2, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in whole.choices]
    assert texts[0] == texts[1] and texts[0]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
