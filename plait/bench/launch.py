"""Start, watch and stop a server process: `plait serve` on a free local port, or any command
line with a `{port}` placeholder (a peer server in scripts/bench_peers.py).

    launch_plait(args)          -> ServerProcess   `python -m plait serve --port <free> *args`
    launch_command(cmd, name)   -> ServerProcess   `cmd` with {port} filled in, own process group
    ServerProcess.wait_healthy(timeout)            poll GET /health until 200 (or the process exits)
    ServerProcess.stop()                           SIGTERM, then SIGKILL after 30 s

The tests' real-server harness (tests/helpers/server.py), scripts/soak.py and
scripts/bench_peers.py share it. Every launch writes the process's stdout and stderr to a
temporary log file, whose tail goes into the error when the server never becomes healthy.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A server subprocess listening on 127.0.0.1:`port`. `own_group`: it leads its own
    process group (launch_command), so stop() signals its children too."""

    port: int
    process: subprocess.Popen
    log_path: Path
    own_group: bool = False

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        """Return once GET /health answers 200; RuntimeError (with the log's tail) if the
        process exits first or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early (status {self.process.returncode}):"
                                   f"\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM (to the whole group if it leads one), SIGKILL if it is still up 30 s later."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if self.process.poll() is not None:
                return
            try:
                if self.own_group:
                    os.killpg(self.process.pid, sig)
                else:
                    self.process.send_signal(sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue


def _log_file(prefix: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return Path(path)


def launch_plait(args: list[str], env: dict[str, str] | None = None,
                 log_prefix: str = "plait-serve-") -> ServerProcess:
    """Start `python -m plait serve --host 127.0.0.1 --port <free> *args` with this
    interpreter; `env` replaces the environment when given. Returns before it is healthy."""
    port = free_port()
    log = _log_file(log_prefix)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "plait", "serve", "--host", HOST, "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return ServerProcess(port, process, log)


def launch_command(command: str, log_prefix: str) -> ServerProcess:
    """Start a shell-style command line with `{port}` replaced by a free port, in its own
    process group. Raises OSError or ValueError if it cannot be started."""
    port = free_port()
    argv = shlex.split(command.replace("{port}", str(port)))
    log = _log_file(log_prefix)
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return ServerProcess(port, process, log, own_group=True)
