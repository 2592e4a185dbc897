#!/usr/bin/env bash
# Prepare a Debian host without a Docker engine or registry access to build and run the image:
# podman/buildah/runc/debootstrap, container limits within the host's hard limits, and an
# offline base image (Debian bookworm + Python 3.11) imported from a debootstrap root FS.
#
#   sudo scripts/podman_setup.sh [BASE_IMAGE_NAME]   # default: localhost/limelight-base:bookworm
#
# Idempotent: each step is skipped when its result is already there. Needs root and access to a
# Debian mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail

BASE="${1:-localhost/limelight-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if [[ "$(id -u)" != 0 ]]; then
  echo "podman_setup.sh needs root (apt-get, debootstrap, rootful podman)" >&2
  exit 1
fi

missing=()
for tool in podman buildah runc debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc debootstrap >/dev/null
fi

# The runtime's default ulimits exceed what some hosts allow; keep them inside the hard limits.
CONF=/etc/containers/containers.conf
if ! grep -qs '^default_ulimits' "$CONF"; then
  nofile="$(ulimit -Hn)"
  [[ "$nofile" == unlimited ]] && nofile=1048576
  mkdir -p "$(dirname "$CONF")"
  touch "$CONF"
  grep -qs '^\[containers\]' "$CONF" || printf '[containers]\n' >>"$CONF"
  # Insert right under the [containers] table header (TOML allows each table once).
  settings="default_ulimits = [\"nofile=${nofile}:${nofile}\", \"nproc=32768:32768\"]"
  grep -qs '^pids_limit' "$CONF" || settings+=$'\npids_limit = 0'
  awk -v add="$settings" '{ print } /^\[containers\]/ { print add }' "$CONF" >"$CONF.new"
  mv "$CONF.new" "$CONF"
  echo "wrote container limits to $CONF"
fi

if ! podman image exists "$BASE"; then
  ROOTFS="$(mktemp -d /var/tmp/limelight-rootfs.XXXXXX)"
  trap 'rm -rf "$ROOTFS"' EXIT
  echo "debootstrap bookworm (minbase + python3) into $ROOTFS"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >/dev/null
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" -c . | podman import - "$BASE" >/dev/null
  echo "imported $BASE"
fi
