#!/usr/bin/env bash
# Build the base images the Dockerfile and docker-compose.yml need where no image registry
# answers (an air-gapped site, or this project's CI machine): a Debian bookworm root file
# system made by debootstrap from Debian's packages, imported with `docker import`.
#
#   splitserve-base:bookworm    python3 (3.11) + venv: an equivalent of python:3.11-slim-bookworm
#                               for the Dockerfile's BASE_IMAGE (the interpreter is /usr/bin/python3,
#                               the Dockerfile only ever calls `python3`)
#   splitserve-redis:bookworm   the same plus Debian's redis-server (user redis, /data), for
#                               SPLITSERVE_REDIS_IMAGE in docker-compose.yml
#
# Usage: docker/build_base_image.sh [--force]    (needs root, debootstrap and a Docker engine)
# Environment: DEBIAN_MIRROR (default: the first deb URI apt uses here, else deb.debian.org),
#              BASE_TAG, REDIS_TAG. Existing images are kept unless --force.
set -euo pipefail

BASE_TAG=${BASE_TAG:-splitserve-base:bookworm}
REDIS_TAG=${REDIS_TAG:-splitserve-redis:bookworm}
SUITE=bookworm
force=0
[[ "${1:-}" == "--force" ]] && force=1

have() { docker image inspect "$1" >/dev/null 2>&1; }
if (( ! force )) && have "$BASE_TAG" && have "$REDIS_TAG"; then
  echo "base images present: $BASE_TAG $REDIS_TAG (--force rebuilds)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 2; }

if [[ -z "${DEBIAN_MIRROR:-}" ]]; then
  DEBIAN_MIRROR=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
                  | awk '{print $2}' | head -n1 || true)
  DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi

work=$(mktemp -d /tmp/splitserve-rootfs.XXXXXX)
cleanup() {
  for m in proc sys dev; do umount -l "$work/rootfs/$m" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
rootfs=$work/rootfs

echo "debootstrap $SUITE from $DEBIAN_MIRROR (minbase + python3) ..."
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,tzdata,netbase \
  "$SUITE" "$rootfs" "$DEBIAN_MIRROR" > "$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

slim() {  # what python:*-slim leaves out too: apt lists, docs, man pages, caches
  rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb \
         "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/info/* "$1"/var/log/*.log \
         "$1"/usr/share/locale/* 2>/dev/null || true
}
cat > "$rootfs/etc/apt/sources.list" <<LIST
deb $DEBIAN_MIRROR $SUITE main
deb $DEBIAN_MIRROR $SUITE-updates main
LIST

import() {  # import $1 (a rootfs) as image $2 with extra --change options
  local dir=$1 tag=$2; shift 2
  tar -C "$dir" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL org.opencontainers.image.title=$tag org.opencontainers.image.description=\"Debian $SUITE (debootstrap) for splitserve\"" \
    "$@" - "$tag" >/dev/null
  echo "imported $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
}

# The base: python3 with venv, nothing else.
cp -a "$rootfs" "$work/base"
slim "$work/base"
import "$work/base" "$BASE_TAG" --change 'CMD ["python3"]'

# Redis: the same root file system plus Debian's redis-server, installed in a chroot (no network
# inside a container needed).
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
mount -t proc proc "$rootfs/proc"
chroot "$rootfs" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null' \
  || { echo "could not install redis-server in the chroot" >&2; exit 1; }
umount -l "$rootfs/proc"
mkdir -p "$rootfs/data"
chroot "$rootfs" chown redis:redis /data
: > "$rootfs/etc/resolv.conf"
slim "$rootfs"
import "$rootfs" "$REDIS_TAG" --change 'USER redis' --change 'WORKDIR /data' --change 'EXPOSE 6379' \
  --change 'CMD ["redis-server", "--protected-mode", "no"]'
