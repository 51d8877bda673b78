"""The commands of docs/deploy.md's ``bash`` blocks: test_docker_stack.py runs each one
(``in_docs`` checks a command it runs is written so in the docs) or lists it in ``NOT_RUN``
with the reason."""

from __future__ import annotations

import re

from tests.deploy.manifests import REPO

DEPLOY_DOC = REPO / "docs" / "deploy.md"

# docs/deploy.md commands this module does not run, and why.
NOT_RUN = {
    "docker build -f deploy/docker/vllm-cpu.Dockerfile -t lmcache-svc-vllm-cpu:0.1.0 .": (
        "PyTorch's CPU index is unreachable here: the local-index form of it runs instead"
    ),
    "docker build -f deploy/docker/vllm.Dockerfile -t lmcache-svc-vllm:0.1.0 .": (
        "vLLM's CUDA image cannot be pulled here (no registry) and there is no GPU"
    ),
    "docker compose --profile gpu up -d": "no GPU and no CUDA image here",
    "kubectl create namespace lmcache": "no Kubernetes cluster here (tests/deploy/test_k8s.py)",
    "kubectl -n lmcache create secret generic lmcache-svc-auth --from-literal=token=$(openssl "
    "rand -hex 32)": "no Kubernetes cluster here",
    "kubectl apply -k deploy/k8s/daemonset": "no Kubernetes cluster here",
}


def doc_commands() -> list[str]:
    """Every command of docs/deploy.md's bash blocks (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DEPLOY_DOC.read_text(), re.DOTALL):
        text = re.sub(r"\\\n\s*", "", block)
        for line in text.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def in_docs(command: str) -> str:
    assert command in doc_commands(), f"docs/deploy.md has no command {command!r}"
    return command
