"""The CPU image, built and run for real (`make test-image`, which builds it first).

Opt-in: skipped unless PLAIT_IMAGE_TEST=1 (set by `make test-image`); with it set, a missing
daemon or image is a failure. The image is `PLAIT_IMAGE` (default plait:<version>-cpu).
Containers run with `--network host` on a free loopback port (PLAIT_HOST / PLAIT_PORT: the
CMD takes both from the environment), no bridge network, and the Deployment's restrictions:
a read-only root filesystem, every capability dropped, no-new-privileges, writable tmpfs
mounts where the Deployment mounts emptyDirs (exec: the engine loads the native kernels it
compiles into PLAIT_CACHE).

    test_image_serves_and_drains   /health, /live, the HEALTHCHECK reaching "healthy", the
                                   uid, torch's CPU build in the log, chat n=2 through the
                                   openai SDK, then a ~20 s stream through `docker stop -t`:
                                   /health 503 (not refused) while it drains, the stream
                                   ends with finish_reason "length" and [DONE], exit 0, no
                                   traceback in the log
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.deploy import DOCKERFILE

import plait
from plait.bench.launch import free_port

IMAGE = os.environ.get("PLAIT_IMAGE", f"plait:{plait.__version__}-cpu")
STARTUP_S = 600  # the image's HEALTHCHECK start period
STREAM_S = 20  # how long the stream that `docker stop` meets should last

pytestmark = pytest.mark.skipif(os.environ.get("PLAIT_IMAGE_TEST") != "1",
                                reason="opt-in: `make test-image` builds the image and runs "
                                       "this with PLAIT_IMAGE_TEST=1")


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True,
                            timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


def logs(cid: str) -> str:
    """The container's output, stdout and stderr together (the server logs to stderr)."""
    result = subprocess.run(["docker", "logs", cid], capture_output=True, text=True,
                            timeout=60, check=False)
    return result.stdout + result.stderr


def stop_timeout() -> int:
    """The `docker stop -t` the Dockerfile documents (test_dockerfile.py checks it covers
    the drain)."""
    (value,) = set(re.findall(r"docker stop -t (\d+)", DOCKERFILE.read_text()))
    return int(value)


@pytest.fixture(scope="module")
def container() -> Iterator[tuple[str, str]]:
    """(container id, base URL) of the image running as the Deployment runs it."""
    assert docker("info", "--format", "{{.ServerVersion}}"), "no Docker daemon answers"
    docker("image", "inspect", IMAGE)
    port = free_port()
    tmpfs = "exec,uid=10001,gid=10001"
    cid = docker("run", "-d", "--network", "host", "-e", "PLAIT_HOST=127.0.0.1",
                 "-e", f"PLAIT_PORT={port}", "--read-only", "--cap-drop", "ALL",
                 "--security-opt", "no-new-privileges",
                 "--tmpfs", f"/var/cache/plait:{tmpfs}", "--tmpfs", f"/home/plait:{tmpfs}",
                 "--tmpfs", "/tmp:exec", IMAGE)
    try:
        yield cid, f"http://127.0.0.1:{port}"
    finally:
        print("\n".join(line for line in logs(cid).splitlines()
                        if "GET /health" not in line)[-4000:])
        docker("rm", "-f", cid, check=False)


def wait_until(predicate, timeout: float, what: str, interval: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def status(url: str) -> int | None:
    """The status of GET url, or None when the connection is refused."""
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.TransportError:
        return None


def test_image_serves_and_drains(container: tuple[str, str]) -> None:
    import openai

    cid, url = container
    wait_until(lambda: status(f"{url}/health") == 200, STARTUP_S, "/health 200")
    assert status(f"{url}/live") == 200
    wait_until(lambda: docker("inspect", "-f", "{{.State.Health.Status}}", cid) == "healthy",
               120, "the HEALTHCHECK reports healthy")
    assert docker("exec", cid, "id", "-u") == "10001"
    assert docker("inspect", "-f", "{{.Config.User}}", cid) == "10001:10001"
    started = logs(cid)
    assert "torch 2.13.0+cpu (CPU build)" in started
    assert "native CPU kernels off" not in started  # PLAIT_CACHE is writable and exec

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, n=2, max_tokens=16, seed=3,
        messages=[{"role": "user", "content": "Name a colour."}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.content for c in chat.choices)
    assert chat.usage.prompt_tokens > 0 and 2 <= chat.usage.completion_tokens <= 32

    # The decode rate here, so that the stream `docker stop` meets lasts about STREAM_S.
    start = time.monotonic()
    probe = client.completions.create(model=model, prompt="Once upon a time", max_tokens=64,
                                      extra_body={"ignore_eos": True})
    rate = probe.usage.completion_tokens / (time.monotonic() - start)
    max_tokens = int(rate * STREAM_S)

    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.Client(timeout=300) as http, \
            http.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        while not events:  # the stream is under way
            line = next(lines)
            if line.startswith("data: "):
                events.append(line[6:])
        stopped_at = time.monotonic()
        stopper = threading.Thread(target=docker, args=("stop", "-t", str(stop_timeout()), cid),
                                   kwargs={"timeout": stop_timeout() + 30})
        stopper.start()
        # readiness turns 503 while the listener stays open
        wait_until(lambda: status(f"{url}/health") == 503, 10, "/health 503 while draining",
                   interval=0.2)
        assert status(f"{url}/live") == 200
        events += [line[6:] for line in lines if line.startswith("data: ")]
        streamed_s = time.monotonic() - stopped_at
        stopper.join()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= max_tokens - 1
    print(f"the stream went on {streamed_s:.1f} s after `docker stop` ({max_tokens} tokens "
          f"at {rate:.0f} tok/s)")
    assert docker("inspect", "-f", "{{.State.ExitCode}}", cid) == "0"
    stopped = logs(cid)
    assert "Traceback" not in stopped and " ERROR " not in stopped
    assert "drained: no request left" in stopped
    with socket.socket() as s:  # and the port is closed now
        assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0
