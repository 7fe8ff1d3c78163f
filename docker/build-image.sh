#!/usr/bin/env bash
# Build Plait's image on a machine like the project's CI machines: `make image` (CPU) and
# `make image-cuda` run this.
#
#   docker/build-image.sh [cpu|cuda]
#
# Environment (all optional):
#   IMAGE            the tag (default plait:<version>-cpu, or plait:<version> for cuda)
#   CPU_BASE_IMAGE   the CPU base. Default: plait-base:bookworm, made by docker/base-image.sh
#                    (debootstrap, offline from Docker Hub) when it is not there yet
#   BASE_IMAGE       the CUDA base (the Dockerfile's default: pytorch/pytorch:...)
#   TORCH_INDEX_URL  where the CPU torch wheel comes from. Default: PyTorch's CPU index when
#                    it answers, else a local index on 127.0.0.1 serving TORCH_WHEEL
#   TORCH_WHEEL      a torch-2.13.0+cpu wheel file (default: found in pip's find-links)
#   EXTRA_INDEX_URL  an extra index for the other packages
#
# The daemon: when none answers, this runs itself under docker/with-dockerd.sh, which starts
# `dockerd --bridge=none --iptables=false` (root only) and stops it again at the end. Builds
# use `--network host` and no bridge network:
# the machines this runs on may only reach loopback and the package registries. The builder:
# BuildKit (`docker buildx`) when the client has it, else the legacy builder. Prints the
# build time and the image size.
set -euo pipefail
target=${1:-cpu}
cd "$(dirname "$0")/.."
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' plait/__init__.py)
if [ "$target" = cpu ]; then image=${IMAGE:-plait:$version-cpu}; else image=${IMAGE:-plait:$version}; fi

cleanup=()
on_exit() { local i; for (( i=${#cleanup[@]}-1; i>=0; i-- )); do eval "${cleanup[i]}" || true; done; }  # last first
trap on_exit EXIT

# ---- a daemon: started for this build only when none answers
if ! docker info >/dev/null 2>&1; then exec docker/with-dockerd.sh "$PWD/docker/build-image.sh" "$target"; fi

args=(--network host -t "$image")
if [ "$target" = cpu ]; then
  args+=(--target cpu)
  # ---- the base
  base=${CPU_BASE_IMAGE:-plait-base:bookworm}
  if ! docker image inspect "$base" >/dev/null 2>&1; then
    if [ -n "${CPU_BASE_IMAGE:-}" ]; then docker pull "$base"; else docker/base-image.sh "$base"; fi
  fi
  args+=(--build-arg "CPU_BASE_IMAGE=$base")
  # ---- the torch wheel
  torch_index=${TORCH_INDEX_URL:-}
  if [ -z "$torch_index" ] && curl -sfI --max-time 10 https://download.pytorch.org/whl/cpu/torch/ >/dev/null 2>&1; then
    torch_index=https://download.pytorch.org/whl/cpu
  fi
  if [ -z "$torch_index" ]; then
    wheel=${TORCH_WHEEL:-}
    if [ -z "$wheel" ]; then
      for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
        found=$(ls "$dir"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
        if [ -n "$found" ]; then wheel=$found; break; fi
      done
    fi
    [ -n "$wheel" ] || { echo "build-image.sh: PyTorch's CPU index does not answer; set TORCH_INDEX_URL or TORCH_WHEEL" >&2; exit 1; }
    # A PEP 503 index of one project on loopback, reachable from a --network host build.
    root=$(mktemp -d /tmp/plait-torch-index.XXXXXX)
    mkdir -p "$root/torch"
    ln -s "$(readlink -f "$wheel")" "$root/torch/$(basename "$wheel")"
    printf '<a href="%s">%s</a>\n' "$(basename "$wheel" | sed 's/+/%2B/')" "$(basename "$wheel")" > "$root/torch/index.html"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$root" "$port" >/dev/null 2>&1 &
    cleanup+=("kill $!; rm -rf $root")
    torch_index=http://127.0.0.1:$port
    for _ in $(seq 20); do curl -sf "$torch_index/torch/" >/dev/null && break; sleep 0.25; done
    echo "build-image.sh: torch from $wheel (served at $torch_index)" >&2
  fi
  args+=(--build-arg "TORCH_INDEX_URL=$torch_index")
elif [ -n "${BASE_IMAGE:-}" ]; then
  args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
if [ -n "${EXTRA_INDEX_URL:-}" ]; then args+=(--build-arg "EXTRA_INDEX_URL=$EXTRA_INDEX_URL"); fi

# ---- the builder
if docker buildx version >/dev/null 2>&1; then
  build=(docker buildx build --load)
else
  build=(env DOCKER_BUILDKIT=0 docker build)
fi
echo "build-image.sh: ${build[*]} ${args[*]} ." >&2
start=$(date +%s)
"${build[@]}" "${args[@]}" .
seconds=$(( $(date +%s) - start ))
size=$(docker image inspect -f '{{.Size}}' "$image")
echo "build-image.sh: built $image in ${seconds} s, $(( size / 1000000 )) MB"
