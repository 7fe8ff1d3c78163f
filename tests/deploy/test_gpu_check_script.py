"""The prepared GPU check runs end to end on CPU with a tiny model (CUDA parts skip)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.paths import REPO

ROOT = REPO


def test_gpu_check_script_runs_on_cpu(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["errors"] == {}
    assert data["kernels"] == {"skipped": "needs CUDA"}
    assert data["parity"]["float32"]["ok"] is True
    assert [row["batch"] for row in data["bench"]["decode"]] == [1, 32, 128]
    shared = {row["n"]: row for row in data["bench"]["shared_prefill"]}
    assert shared[100]["plait_prompt_tokens_computed"] == shared[100]["prompt_len"]
    table = (tmp_path / "results.md").read_text()
    assert "## decode throughput" in table and "## shared prefill" in table


def test_gpu_check_shell_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
