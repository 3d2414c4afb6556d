# splitserve image: one image for every service (`splitserve serve gateway|coordinator|scheduler|worker`).
#
#   docker build -t splitserve:cpu .                                  # CPU; pulls from the package index
#   make wheels && docker build -t splitserve:cpu .                   # offline: from docker/wheelhouse
#   docker/build_base_image.sh && docker build --build-arg BASE_IMAGE=splitserve-base:bookworm -t splitserve:cpu .
#                                                                     # no image registry: a debootstrap base
#   docker build --build-arg VARIANT=cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg BUILDER_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 -t splitserve:cuda .
#                                                                     # CUDA: torch cu128, flash-attn, NIXL (CUDA build)
#
# Stages: `deps` makes the virtualenv /opt/venv with the dependencies (from the wheelhouse or the
# index), `builder` installs the project into /opt/app, `venv` strips pip/setuptools/wheel; the
# final stage copies only /opt/venv and /opt/app onto a clean base (no compiler, no pip, no
# wheelhouse) and runs as a non-root user.
# Works with the legacy builder and BuildKit alike (no RUN --mount).

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILDER_IMAGE=${BASE_IMAGE}

# Dependencies only (torch, transformers, grpc, ...): this layer is rebuilt only when
# pyproject.toml or the wheelhouse change, not on every source change.
FROM ${BUILDER_IMAGE} AS deps
# cpu | cuda
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Where torch comes from in an online build (the wheelhouse wins when it holds wheels).
ARG TORCH_INDEX_URL=
# 1: install NIXL (KV transfer over UCX; auto: on for cuda). Without it KV moves over gRPC.
ARG WITH_NIXL=auto
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
COPY docker/install_venv.sh /tmp/install_venv.sh
# An empty wheelhouse (only its .gitignore) means an online build.
COPY docker/wheelhouse/ /wheelhouse/
COPY pyproject.toml /src/pyproject.toml
RUN sh /tmp/install_venv.sh deps

# The project itself, into /opt/app (no dependencies: they are in /opt/venv).
FROM deps AS builder
COPY README.md /src/
COPY splitserve /src/splitserve
COPY gateway /src/gateway
COPY services /src/services
COPY workers /src/workers
COPY loadgen /src/loadgen
RUN sh /tmp/install_venv.sh app

# /opt/venv without pip, setuptools and wheel (what the final image copies).
FROM deps AS venv
RUN sh /tmp/install_venv.sh strip

FROM ${BASE_IMAGE}
ARG VARIANT=cpu
ARG VERSION=0.1.0
ARG REVISION=unknown
# CUDA base images carry no Python: the same interpreter the builder used (no compiler).
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; fi \
 && echo "splitserve:x:10001:10001:splitserve:/home/splitserve:/usr/sbin/nologin" >> /etc/passwd \
 && echo "splitserve:x:10001:" >> /etc/group \
 && mkdir -p /home/splitserve /models && chown 10001:10001 /home/splitserve
COPY --from=venv /opt/venv /opt/venv
COPY --from=builder /opt/app /opt/app
COPY docker/entrypoint.sh /usr/local/bin/splitserve-entrypoint
COPY docker/healthcheck.py /usr/local/bin/splitserve-healthcheck
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/app \
    HOME=/home/splitserve \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    SPLITSERVE_WORKER_HOST=0.0.0.0 \
    SPLITSERVE_SCHEDULER_HOST=0.0.0.0 \
    SPLITSERVE_COORDINATOR_HOST=0.0.0.0 \
    SPLITSERVE_GATEWAY_HOST=0.0.0.0 \
    SPLITSERVE_LOG_JSON=true
LABEL org.opencontainers.image.title="splitserve" \
      org.opencontainers.image.description="splitserve: distributed LLM serving (gateway, global scheduler, coordinator, worker)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.splitserve.variant="${VARIANT}"
USER 10001:10001
WORKDIR /home/splitserve
# gateway gRPC, gateway HTTP (+ /metrics), worker, scheduler, coordinator, metrics of the others
EXPOSE 50051 8000 50061 50071 50081 9100
# Readiness of whichever service PID 1 is (grpc.health.v1, service ""): SERVING once it can serve.
HEALTHCHECK --interval=5s --timeout=4s --start-period=180s --retries=3 \
  CMD ["/opt/venv/bin/python", "/usr/local/bin/splitserve-healthcheck"]
ENTRYPOINT ["/usr/local/bin/splitserve-entrypoint"]
CMD ["--help"]
