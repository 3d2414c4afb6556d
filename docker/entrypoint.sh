#!/bin/sh
# Container entry point: `splitserve ARGS` (e.g. `serve worker`), or any other command as given.
# A worker listening on every address (SPLITSERVE_WORKER_HOST=0.0.0.0, the image's default) advertises the container's
# own IP unless SPLITSERVE_WORKER_ADVERTISE_ADDRESS is set: replicas of one compose service
# share a name, and 0.0.0.0 is nothing another container can dial.
set -e
case "${1:-}" in
  serve|up|status|bench|simulate|profile|demo-model|generate|run-demo|plan|--help|-h) ;;
  *) exec "$@" ;;
esac
if [ "${1:-}" = serve ] && [ "${2:-}" = worker ] && [ -z "${SPLITSERVE_WORKER_ADVERTISE_ADDRESS:-}" ]; then
  case "${SPLITSERVE_WORKER_HOST:-0.0.0.0}" in
    0.0.0.0|::|"")
      ip=$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
      export SPLITSERVE_WORKER_ADVERTISE_ADDRESS="$ip:${SPLITSERVE_WORKER_PORT:-50061}" ;;
  esac
fi
exec splitserve "$@"
