#!/usr/bin/env bash
# Make the CPU image's base offline, without Docker Hub: a minimal Debian bookworm made by
# debootstrap from a Debian mirror, with Python 3.11, a C compiler (the engine compiles its
# native CPU kernels at first start) and a virtual environment on PATH (Debian's own python3
# refuses `pip install`: "externally managed"). Then `docker import` as TAG.
#
#   sudo docker/base-image.sh [TAG] [MIRROR]
#   TAG     default plait-base:bookworm
#   MIRROR  default: the first Debian mirror in this machine's apt sources, else
#           http://deb.debian.org/debian
#
# The CAs this machine added to its trust store (/usr/local/share/ca-certificates) are
# trusted in the base too, and stay in images built on it.
#
# What the Dockerfile's CPU stage needs of a base, made here: `python` and `pip` on PATH, a
# pip allowed to install (here /opt/venv), `apt-get`, `groupadd`/`useradd`, gcc + libc6-dev.
# Needs root, debootstrap (Debian package `debootstrap`) and a running Docker daemon.
# Takes about 2-4 minutes; the image is about 480 MB.
set -euo pipefail

tag=${1:-plait-base:bookworm}
mirror=${2:-}
if [ -z "$mirror" ]; then
  mirror=$(grep -rhoE '^(deb +|URIs: +)https?://[^ ]+/debian/?( |$)' \
             /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
           | grep -oE 'https?://[^ ]+' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
command -v debootstrap >/dev/null || { echo "base-image.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "base-image.sh: run as root (debootstrap and chroot)" >&2; exit 1; }

root=$(mktemp -d /tmp/plait-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base-image.sh: debootstrap bookworm from $mirror into $root" >&2
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,ca-certificates,gcc,libc6-dev \
  bookworm "$root" "$mirror" >&2
chroot "$root" /usr/bin/python3 -m venv /opt/venv
# The build machine's own added CAs (a TLS-inspecting proxy's, say), trusted in the base so
# that pip and apt inside builds reach their registries as this machine does. pip uses the
# system bundle (PIP_CERT below), not the certifi copy it vendors.
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >&2
fi
# apt inside builds: the same mirror, and no package caches kept in the image
printf 'deb %s bookworm main\n' "$mirror" > "$root/etc/apt/sources.list"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' \
  - "$tag" >/dev/null
echo "$tag"
