"""Helpers for the deployment-file tests (test_dockerfile.py, test_k8s_manifests.py): where the
files are, the container port, and a small Dockerfile parser.

    dockerfile_instructions(text) -> [(INSTRUCTION, arguments)]   comments dropped, lines joined
    final_stage_of(instructions)  -> the instructions from the last FROM on
    stages_of(instructions)       -> {stage name: its instructions}, FROM included
    env_of(stage)                 -> {name: value} of the stage's ENV instructions
    kustomize_build(folder)       -> the rendered documents (`kubectl kustomize`), or skip
    serve_flags()                 -> the options `plait serve --help` lists
    get_status(path)              -> the status of GET path on an app whose engine never loaded
"""

from __future__ import annotations

import argparse
import functools
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
K8S_DIR = REPO / "docker"
CRD_DIR = REPO / "tests" / "deploy" / "crds"
CONTAINER_PORT = 8000
# The Dockerfile's runtime targets: `--target cpu`, and the default (last) stage.
RUNTIME_STAGES = ("cpu", "cuda")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are skipped
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def final_stage_of(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (k, _) in enumerate(instrs) if k == "FROM"]
    assert starts, "Dockerfile has no FROM"
    return instrs[starts[-1]:]


def stages_of(instrs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions (its FROM first), keyed by its `AS` name (else its index)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for k, args in instrs:
        if k == "FROM":
            words = args.split()
            name = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else str(len(stages))
            assert name not in stages, f"two stages named {name!r}"
            current = stages[name] = []
        if current is not None:
            current.append((k, args))
    return stages


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for k, args in stage:
        if k != "ENV":
            continue
        parts = shlex.split(args)
        if parts and "=" not in parts[0]:  # legacy `ENV KEY value`
            env[parts[0]] = " ".join(parts[1:])
            continue
        for part in parts:
            key, _, value = part.partition("=")
            env[key] = value
    return env


def kustomize_build(folder: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize folder` (kustomize built into kubectl), parsed; skips without kubectl."""
    import pytest
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: overlays are checked file by file only")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"kubectl kustomize {folder}:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def serve_flags() -> set[str]:
    """Every option string of `plait serve` (what `plait serve --help` lists)."""
    from plait.cli import build_parser

    parser = build_parser({})
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(commands.choices["serve"]._option_string_actions)


@functools.cache
def _client() -> Any:
    from fastapi.testclient import TestClient

    from plait.server.app import create_app
    from plait.server.settings import ServerSettings

    return TestClient(create_app(ServerSettings()))  # no lifespan: the engine never loads


def get_status(path: str) -> int:
    """The status of `GET path` on the real app before its engine loaded: 404 if no such
    route, 503 for /health (not ready yet)."""
    return _client().get(path).status_code
