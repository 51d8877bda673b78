# lmcache-svc's server image (docs/deploy.md): Python slim, a virtualenv holding '.[server]'
# (no torch), non-root (uid 10001), HEALTHCHECK on /healthz, SIGTERM = clean stop.
#
#   docker build -t lmcache-svc:0.1.0 .
#
# The engine images have their own files (one stage each, so that no builder, BuildKit or
# the classic one that builds every stage before its target, ever builds one for another):
#   deploy/docker/vllm.Dockerfile      vLLM's official CUDA image plus the client and plugin
#   deploy/docker/vllm-cpu.Dockerfile  the CPU build of vLLM plus the client and plugin
#
# Install and run commands are the README's (pip install '.[server]', lmcache-svc serve),
# which CI runs; tests/deploy/test_image.py checks they agree, and
# tests/deploy/test_docker_stack.py builds and runs the images.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the server's virtualenv ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/lmcache-svc
ENV PATH=/opt/lmcache-svc/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lmcache_svc ./lmcache_svc
RUN pip install '.[server]'

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
