"""Fixtures for the vLLM plugin's tests.

Unit tests import the plugin's vLLM-free modules straight from ``connectors/vllm`` (the
test venv has torch but not vLLM). End-to-end tests (marked ``vllm``) run real engines
with ``.venv-vllm``'s interpreter and skip, saying why, when that venv is missing; they
share one set of engines (``env``, see ``e2e.py``) for the whole session.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_svc_bench.vllm.engines import VLLM_PYTHON
from tests.helpers import import_plugin_from_source
from tests.vllm.e2e import Env, start_env

import_plugin_from_source()


def require_vllm_venv() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing: run scripts/setup_vllm.sh first (CI does)")


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_vllm_venv()
    yield from start_env(tmp_path_factory.mktemp("vllm-e2e"))
