#!/usr/bin/env bash
# Print the name of the Python base image to build streamppo's images on, making it first if need be.
#
#   deploy/docker/base-image.sh            -> python:3.11-slim-bookworm where a registry answers (or it is present)
#                                          -> streamppo-base:bookworm otherwise, bootstrapped from Debian's packages
#
# Where no container registry answers (Docker Hub included), the base is Debian bookworm's minimal root filesystem
# (debootstrap --variant=minbase) with Debian's Python 3.11, imported with `docker import`; it is made once and kept.
# STREAMPPO_BASE_IMAGE names another base and skips both. Progress goes to stderr; stdout is the image name alone.
set -euo pipefail

PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
LOCAL_BASE=${LOCAL_BASE:-streamppo-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "base-image: $*" >&2; }

if [ -n "${STREAMPPO_BASE_IMAGE:-}" ]; then
  echo "$STREAMPPO_BASE_IMAGE"
  exit 0
fi
for image in "$PYTHON_IMAGE" "$LOCAL_BASE"; do
  if docker image inspect "$image" >/dev/null 2>&1; then
    say "using $image (present)"
    echo "$image"
    exit 0
  fi
done
if timeout 60 docker pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
  say "using $PYTHON_IMAGE (pulled)"
  echo "$PYTHON_IMAGE"
  exit 0
fi

say "no registry gave $PYTHON_IMAGE: bootstrapping $LOCAL_BASE from Debian bookworm ($MIRROR)"
if ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; }
fi
root=$(mktemp -d /var/tmp/streamppo-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" >&2
# The suites python:3.11-slim-bookworm reads too, so a pinned Debian package resolves alike on both bases.
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
# This machine's trust store, and every Python client pointed at it: where HTTPS goes through a proxy that signs
# with its own authority, pip in a build trusts what pip here trusts.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
say "made $LOCAL_BASE"
echo "$LOCAL_BASE"
