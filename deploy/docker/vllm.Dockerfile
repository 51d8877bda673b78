# vLLM's official CUDA image plus the lmcache-svc client and connector plugin (GPU engines):
#
#   docker build -f deploy/docker/vllm.Dockerfile -t lmcache-svc-vllm:0.1.0 .
#
# The build context is the repository (its .dockerignore). vLLM's entrypoint (`vllm serve`)
# is kept.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /tmp/lmcache-svc/
COPY lmcache_svc /tmp/lmcache-svc/lmcache_svc
COPY connectors/vllm /tmp/lmcache-svc/connectors/vllm
# The client part of lmcache-svc (grpcio, protobuf, numpy: no server extras) and the plugin,
# into vLLM's own environment. (PIP_BREAK_SYSTEM_PACKAGES: vLLM installs into the system
# interpreter, which a distribution may mark externally managed.)
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
      /tmp/lmcache-svc /tmp/lmcache-svc/connectors/vllm \
 && rm -rf /tmp/lmcache-svc
