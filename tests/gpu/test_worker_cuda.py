"""The plugin's worker half on CUDA KV caches against a real server (GPU machines only).

The KV caches are laid out exactly like vLLM 0.32's on CUDA (``kv_layout.py``); the worker
runs its CUDA flow: layer-wise saves on its copy stream, page-locking of the mapped
segment, loads whose layers the forward pass waits for on the device. A second test
plants the bug that flow exists to prevent -- a layer read before its load copies finish --
and shows the check catching it.
"""

# ruff: noqa: E402  (imports after the CUDA check)
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cuda_marks import NEEDS_CUDA, cuda_available

if not cuda_available():
    pytest.skip(NEEDS_CUDA, allow_module_level=True)

import torch
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.metadata import LoadPlan, SavePlan, StepPlan
from lmcache_svc_vllm.stats import StatsRecorder
from lmcache_svc_vllm.streams import CudaCopyStream
from lmcache_svc_vllm.worker import WorkerSide

from lmcache_svc.client import CacheClient
from lmcache_svc.keys import chunk_hashes
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.gpu.kv_layout import KVShape, make_kv_caches, namespace_for, page_order
from tests.helpers import wait_until

SHAPE = KVShape(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_size=128)
CHUNK = 128  # tokens: 8 blocks of 16, the plugin's default on CUDA
NAMESPACE = namespace_for(SHAPE, "gpu-worker-test", CHUNK)
HASHES = tuple(chunk_hashes(NAMESPACE, list(range(5000, 5000 + 3 * CHUNK))))
SAVED = (3, 9, 4, 40, 41, 42, 43, 7, 12, 13, 14, 15, 16, 17, 18, 19)  # two chunks' blocks
LOADED = (60, 59, 58, 57, 56, 55, 54, 53, 20, 22, 24, 26, 28, 30, 32, 34)
# About 0.1 s of a GPU's clock: the copy stream's work starts that late, so a layer read
# that does not wait for its event reads the blocks before they are loaded.
COPY_DELAY_CYCLES = 200_000_000


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("gpu-worker"))
    yield proc
    proc.cleanup()


def make_worker(url: str, seed: int) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    config = ConnectorConfig(url=url, chunk_size=CHUNK, use_shm=True)
    worker = WorkerSide(
        NAMESPACE,
        ServerLink(config, NAMESPACE, "gpu-test-worker"),
        StatsRecorder(),
        num_blocks=SHAPE.num_blocks,
        page_order=page_order(SHAPE),
    )
    caches = make_kv_caches(SHAPE, seed=seed, device="cuda")
    worker.register_kv_caches(caches)
    assert worker._mover is not None, "the worker refused the CUDA KV layout"
    return worker, caches


def store_two_chunks(server: ServerProc) -> dict[str, torch.Tensor]:
    """Save two chunks with the CUDA flow: each layer as soon as it 'ran', then the rest."""
    with CacheClient(server.socket) as client:
        client.delete(client.register_namespace(NAMESPACE), HASHES)
    src, caches = make_worker(server.socket, seed=1)
    plan = StepPlan(saves=[SavePlan("r1", (HASHES[:2],), SAVED)])
    src.bind(plan)
    assert src._reservation is not None
    src._reservation.result(timeout=10)
    for i in range(SHAPE.num_layers):
        src.save_layer(layer(i))
    assert src._saved_layers == set(range(SHAPE.num_layers)), "saves were not layer-wise"
    src.wait_for_save(plan)
    with CacheClient(server.socket) as client:
        ns_id = client.register_namespace(NAMESPACE)
        wait_until(lambda: client.lookup(ns_id, HASHES).num_hit_chunks >= 2, 10, "2 chunks stored")
    src.shutdown()
    return caches


def load(worker: WorkerSide, req_id: str, blocks: tuple[int, ...]) -> None:
    plan = StepPlan(loads=[LoadPlan(req_id, (HASHES[:2],), 0, blocks, is_async=False)])
    worker.bind(plan)
    worker.start_load(plan)
    assert worker.take_load_errors() == set()


def forward_reads(worker: WorkerSide, caches: dict[str, torch.Tensor], *, wait: bool) -> list:
    """What a forward pass would read of the loaded blocks, layer by layer, on the compute
    stream; ``wait=False`` plants the missing ``wait_for_layer_load``."""
    reads = []
    for i in range(SHAPE.num_layers):
        if wait:
            worker.wait_for_layer(layer(i))
        reads.append(caches[layer(i)][list(LOADED)].clone())
    torch.cuda.synchronize()
    return reads


def matches(reads: list, saved: dict[str, torch.Tensor]) -> list[bool]:
    return [torch.equal(r, saved[layer(i)][list(SAVED)]) for i, r in enumerate(reads)]


def test_layerwise_saves_and_loads_round_trip_on_cuda(server: ServerProc) -> None:
    saved = store_two_chunks(server)
    dst, caches = make_worker(server.socket, seed=2)
    load(dst, "r2", LOADED)
    assert all(matches(forward_reads(dst, caches, wait=True), saved))
    assert dst._pinner is not None and dst._pinner.wait_idle(60)
    assert dst._pinner.registered, "the mapped segment was not page-locked"
    dst.shutdown()
    assert dst._pinner.registered == [], "shutdown left parts registered"


@pytest.mark.parametrize("planted", [False, True], ids=["waits", "missing-wait"])
def test_a_layer_read_before_its_load_completes_is_caught(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    saved = store_two_chunks(server)
    dst, caches = make_worker(server.socket, seed=3)
    load(dst, "warm-up", tuple(range(36, 52)))  # blocks LOADED does not use
    torch.cuda.synchronize()
    # Page-locked, the arena's copies are truly asynchronous (a copy from pageable memory
    # may block the host until it is done, which would hide the race).
    assert dst._pinner is not None and dst._pinner.wait_idle(60) and dst._pinner.registered
    follow = CudaCopyStream.follow_current

    def late(self: CudaCopyStream) -> None:
        follow(self)
        with self.activate():
            torch.cuda._sleep(COPY_DELAY_CYCLES)

    monkeypatch.setattr(CudaCopyStream, "follow_current", late)
    before = caches[layer(0)][list(LOADED)].clone()
    load(dst, "r2", LOADED)
    result = matches(forward_reads(dst, caches, wait=not planted), saved)
    if planted:
        assert not all(result), "a read that skipped its wait saw the loaded bytes"
    else:
        assert all(result)
    torch.cuda.synchronize()
    assert all(matches(forward_reads(dst, caches, wait=True), saved))  # loaded in the end
    assert not torch.equal(before, saved[layer(0)][list(SAVED)])  # so the race is visible
    dst.shutdown()
