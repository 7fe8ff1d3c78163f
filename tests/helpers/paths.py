"""Where things are, for tests that read repository files or run Python in a subprocess.

    REPO, TESTS, SCRIPTS          the checkout's root, tests/ and scripts/
    run_python(code, cwd)         `python -c code` with this interpreter
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
SCRIPTS = REPO / "scripts"


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    """`python -c code` run from `cwd`: give a folder outside the checkout, where only
    site-packages is searched (from the root, kernels/ would shadow PyPI's `kernels`)."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
