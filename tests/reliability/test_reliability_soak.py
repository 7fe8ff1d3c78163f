"""A short soak (scripts/soak.py, K=6 clients for 20 s) against the reliability server, whose
small admission window (4 running + 8 queued) makes refusals part of the run: no 5xx, every
request accounted for, KV blocks and memory back at rest afterwards.

It asserts accounting, never speed: how many requests a loaded machine serves in 20 s (or
whether one of them happened to be refused or hung up on) is not a property of the server."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers.paths import SCRIPTS
from helpers.server import API_KEY, RemoteServer, reliability_server

SCRIPT = SCRIPTS / "soak.py"


@pytest.fixture(scope="module")
def soak_module():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server() -> RemoteServer:
    return reliability_server()


async def test_short_soak(server: RemoteServer, soak_module) -> None:
    refused = 'plait_requests_refused_total{reason="overloaded"}'
    before = server.metrics()[refused]
    log_start = len(server.log())
    report = await soak_module.soak(server.url, k=6, seconds=20, api_key=API_KEY,
                                    pid=server.process.pid, max_tokens=32, seed=1)
    print(soak_module.summary(report))
    assert soak_module.failures(report, max_rss_growth_mb=256) == []
    assert report["finished"] >= 1  # something was served; how much depends on the machine
    assert server.metrics()[refused] - before == report["refused"]  # both sides agree
    assert "Traceback" not in server.log()[log_start:]
