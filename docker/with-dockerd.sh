#!/usr/bin/env bash
# Run a command with a Docker daemon to talk to: when none answers, start
# `dockerd --bridge=none --iptables=false` (root only; no bridge network, no iptables rules:
# containers and builds use --network host), run the command, then stop that daemon again.
# A daemon that was already running is left alone.
#
#   docker/with-dockerd.sh COMMAND [ARGS...]
set -euo pipefail
if docker info >/dev/null 2>&1; then exec "$@"; fi
[ "$(id -u)" -eq 0 ] || { echo "with-dockerd.sh: no Docker daemon answers, and starting one needs root" >&2; exit 1; }
command -v dockerd >/dev/null || { echo "with-dockerd.sh: no dockerd (Debian: apt-get install docker.io)" >&2; exit 1; }
log=$(mktemp /tmp/plait-dockerd.XXXXXX.log)
echo "with-dockerd.sh: starting dockerd --bridge=none --iptables=false (log $log)" >&2
dockerd --bridge=none --iptables=false >"$log" 2>&1 &
pid=$!
stop() { kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; echo "with-dockerd.sh: dockerd stopped" >&2; }
trap stop EXIT
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
docker info >/dev/null 2>&1 || { echo "with-dockerd.sh: dockerd did not start; see $log" >&2; exit 1; }
status=0
"$@" || status=$?
exit "$status"
