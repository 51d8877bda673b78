"""The HBM tier in a real server on a real device (GPU machines only): chunks evicted from
the arena are demoted into GPU memory, found there by a lookup, and come back identical
when loaded (promoted into the arena)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from lmcache_svc.client import CacheClient
from lmcache_svc_bench.procs import start_server
from tests.cuda_marks import requires_cuda
from tests.helpers import make_chunk
from tests.server.test_tiers_e2e import CHUNKS, store_all

pytestmark = requires_cuda


def test_arena_evictions_land_in_hbm_and_load_back_identical(tmp_path: Path) -> None:
    from tests.server.test_grpc import CHUNK, NS

    env = {"LMCACHE_SVC_HBM__CAPACITY": "8MiB"}
    server = start_server(tmp_path, "--cpu-bytes", "1MiB", env=env)
    try:
        hashes = store_all(server.socket)
        with CacheClient(server.socket) as c:
            ns_id = c.register_namespace(NS)
            found = c.lookup(ns_id, hashes)
            assert found.num_hit_chunks == CHUNKS
            assert found.tiers[0] == "hbm" and found.tiers[-1] == "cpu", found.tiers
            num_in_hbm = found.tiers.count("hbm")
            assert found.media[:num_in_hbm] == ["device"] * num_in_hbm
            got = c.load(ns_id, hashes[:4])  # device to host, into the arena
            assert got == [make_chunk(i, CHUNK) for i in range(4)]
            assert c.lookup(ns_id, hashes[:4]).tiers == ["cpu"] * 4
        metrics = httpx.get(f"{server.http_url}/metrics", timeout=5).text
        assert 'lmcache_svc_promotions_total{tier="cpu"} 4.0' in metrics
        demoted = re.search(r'lmcache_svc_demotions_total\{tier="hbm"\} ([0-9.]+)', metrics)
        assert demoted is not None and float(demoted.group(1)) >= num_in_hbm
    finally:
        server.cleanup()
