"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_svc.cache.chunk_index import CHECK_LOCKS_ENV
from lmcache_svc_bench.redis_procs import (
    RedisClusterProcs,
    RedisProc,
    redis_server_path,
    start_redis,
    start_redis_cluster,
)

os.environ[CHECK_LOCKS_ENV] = "1"  # every chunk-index change checks the cache's lock is held
# (servers the tests start as processes inherit it)

# -- Redis: real redis-server processes on free ports --------------------------------------


def _require_redis(cluster: bool = False) -> None:
    if redis_server_path() is None:
        pytest.skip("redis-server is not on PATH (CI's set-up installs it)")
    if cluster and shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not on PATH (needed to create a Redis Cluster)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    """One redis-server for the session; tests isolate themselves by key prefix."""
    _require_redis()
    proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A three-master Redis Cluster for the session."""
    _require_redis(cluster=True)
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProc]]:
    """Starts private redis-servers (``port=`` to restart on one); stops them all afterwards."""
    _require_redis()
    started: list[RedisProc] = []

    def start(port: int | None = None, extra_args: tuple[str, ...] = ()) -> RedisProc:
        proc = start_redis(tmp_path, port=port, extra_args=extra_args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
