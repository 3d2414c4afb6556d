#!/bin/sh
# Build steps of the Dockerfile (one argument: the step).
#   deps   /opt/venv: torch first, then the project's dependencies (pyproject.toml), NIXL, flash-attn
#          (cuda); from /wheelhouse (offline: --no-index, pinned by its constraints.txt) when it
#          holds wheels, else from the package index
#   app    the project (no dependencies) into /opt/app
#   strip  remove pip, setuptools and wheel from /opt/venv
set -eu
step=${1:?step: deps | app | strip}
VARIANT=${VARIANT:-cpu}
PIP=/opt/venv/bin/pip
if ls /wheelhouse/*.whl >/dev/null 2>&1; then
  FROM="--no-index --find-links /wheelhouse -c /wheelhouse/constraints.txt"
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse   # also for the isolated build env of the project
else
  FROM=""
fi
case $step in
deps)
  if ! command -v python3 >/dev/null || ! python3 -c "import ensurepip" 2>/dev/null; then
    # the CUDA devel images: Ubuntu's python3 and venv (and git, for flash-attn's build)
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-dev git
  fi
  python3 -m venv /opt/venv
  if [ -n "$FROM" ]; then
    echo "offline build: $(ls /wheelhouse/*.whl | wc -l) wheels in /wheelhouse"
    # torch first: the project's plain `torch>=2.4` must not pull a CUDA build
    $PIP install $FROM "torch==${TORCH_VERSION}"
  else
    url=${TORCH_INDEX_URL:-}
    if [ -z "$url" ]; then
      if [ "$VARIANT" = cuda ]; then url=https://download.pytorch.org/whl/cu128; else url=https://download.pytorch.org/whl/cpu; fi
    fi
    echo "online build: torch from $url"
    $PIP install --index-url "$url" "torch==${TORCH_VERSION}"
  fi
  # The SDK's base dependencies and the extras a serving image needs (server, gguf, tracing;
  # docs/packaging.md), without the extras' references to the project itself.
  /opt/venv/bin/python - > /tmp/requirements.txt <<'PY'
import tomllib
project = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]
wanted = list(project["dependencies"])
for extra in ("server", "gguf", "tracing"):
    wanted += [d for d in project["optional-dependencies"][extra] if not d.startswith("splitserve")]
print("\n".join(dict.fromkeys(wanted)))
PY
  $PIP install $FROM -r /tmp/requirements.txt
  nixl=${WITH_NIXL:-auto}
  [ "$nixl" = auto ] && { [ "$VARIANT" = cuda ] && nixl=1 || nixl=0; }
  if [ "$nixl" = 1 ]; then
    # the CUDA-13 wheel carries the UCX plugins; --no-deps keeps pip from pulling the CUDA-12 variant
    $PIP install $FROM "nixl-cu13>=1.5" && $PIP install $FROM --no-deps "nixl>=1.5"
  fi
  if [ "$VARIANT" = cuda ]; then
    # flash-attn compiles against torch's CUDA (nvcc of the devel image); only the result is copied
    $PIP install --no-build-isolation "flash-attn>=2.6"
  fi
  ;;
app)
  $PIP install $FROM --no-deps --target /opt/app /src
  PYTHONPATH=/opt/app /opt/venv/bin/python -c "import splitserve.cli.app, workers.server, gateway.server, services.coordinator.server, torch; print('torch', torch.__version__)"
  ;;
strip)
  # (the bytecode pip compiled stays: the non-root user could not write it, every start would
  # recompile torch's and transformers' modules)
  $PIP uninstall -q -y pip setuptools wheel
  ;;
esac
