"""Helpers for the deployment-file tests (test_dockerfile.py, test_k8s_manifests.py): where the
files are, the container port, and a small Dockerfile parser.

    dockerfile_instructions(text) -> [(INSTRUCTION, arguments)]   comments dropped, lines joined
    final_stage_of(instructions)  -> the instructions from the last FROM on
    env_of(stage)                 -> {name: value} of the stage's ENV instructions
"""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
CONTAINER_PORT = 8000


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
