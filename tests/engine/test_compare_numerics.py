"""scripts/compare_numerics.py on the tiny model: one configuration against itself is exact,
and two that differ print their difference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import SCRIPTS

SCRIPT = SCRIPTS / "compare_numerics.py"


def run(tiny_path: Path, a: str, b: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_path), "--a", a,
                             "--b", b, "--tokens", "8"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_same_configuration_is_exact(tiny_path) -> None:
    out = run(tiny_path, "num_kv_blocks=64", "num_kv_blocks=64")
    assert "over 32 generated tokens: mean 0.00000, max 0.00000" in out
    assert "greedy tokens equal on 4/4 prompts x 8 tokens" in out


def test_options_reach_the_engine(tiny_path) -> None:
    # float64 is not a CPU dtype Plait offers: the engine refuses it, so the script fails
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_path),
                             "--b", "dtype=float64", "--a", "num_kv_blocks=64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "dtype" in result.stderr
