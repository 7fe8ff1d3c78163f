#!/usr/bin/env bash
# One prepared GPU check (see scripts/gpu_check.py). Usage: scripts/gpu_check.sh [OUT_DIR]
# On the lent device machine: scripts/gpu_check.sh "$OUT" (only files under $OUT come back),
# with a timeout_s of 500 or more: 90 s of kernel tests + 360 s of checks, both capped, so
# the whole script stays under 8 minutes.
# gpu_check.py saves its results after every section.
# Installs nothing from the network: the project is installed with --no-index, or, if that
# is impossible (externally managed Python, no pip, old setuptools), imported through a
# symlinked `plait` package on PYTHONPATH. `python -P` keeps the repository's own `plait/`
# folder (which lacks engine/ and kernels/) from shadowing either.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
if ! "$PY" -P -c "import plait.engine" 2>/dev/null; then
  if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . >"$out/pip.log" 2>&1; then
    echo "pip could not install the project (see $out/pip.log); using a PYTHONPATH shim"
    shim="$(mktemp -d)/plait"
    mkdir -p "$shim"
    for f in plait/*.py; do ln -s "$PWD/$f" "$shim/"; done
    for pkg in engine kernels server; do ln -s "$PWD/$pkg" "$shim/$pkg"; done
    export PYTHONPATH="$(dirname "$shim")${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
"$PY" -P -c "import plait.engine, plait.kernels; print('plait imports from', plait.__file__)"
# The suite's CUDA-marked kernel tests, where pytest exists (they need nothing else).
if "$PY" -P -c "import pytest" 2>/dev/null; then
  timeout 90 "$PY" -P -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_kernels_triton.py \
    2>&1 | tee "$out/kernel_tests.log" || echo "CUDA kernel tests FAILED: see $out/kernel_tests.log"
else
  echo "no pytest here: the CUDA kernel tests are skipped; gpu_check.py's kernels section runs"
fi
timeout 360 "$PY" -P -u scripts/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu_check.log"
