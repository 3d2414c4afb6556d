#!/usr/bin/env bash
# Docker for the deployment test (tests/e2e/test_compose.py, extended tier: `make test-all`
# runs this first; it builds the images and runs docker-compose.yml): use the engine that
# answers, else install Debian's docker.io / docker-compose / debootstrap if missing and start
# dockerd in the background (no iptables: the test uses host networking only). Images built by
# earlier runs stay in /var/lib/docker, so a later run rebuilds only what changed. When no engine
# can be started the test is skipped, saying why.
if ! docker info >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1 \
    || ! (command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1); then
  missing=""
  command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
  command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing="$missing docker-compose"
  command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
  if [ -n "$missing" ]; then
    echo "installing$missing (for the Docker deployment test)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing) >/dev/null 2>&1 \
      || echo "could not install$missing: the Docker deployment test will be skipped"
  fi
  if ! docker info >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1; then
    echo "starting dockerd (log: /tmp/splitserve-ci-dockerd.log)"
    (setsid dockerd --iptables=false >/tmp/splitserve-ci-dockerd.log 2>&1 < /dev/null &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || echo "dockerd did not start: the Docker deployment test will be skipped"
  fi
fi
