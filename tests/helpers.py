"""Factories the tests share: layouts, namespaces, chunk keys, chunk hashes and payloads;
and the waits and counters that keep tests off the wall clock (``wait_until``,
``count_calls``).

The factories are deterministic (the same arguments give the same value), so a test builds a
chunk again to compare it with what it reads back. The defaults fit together:
``make_chunk(seed)`` is one chunk of ``make_namespace()``
(16 tokens x 2 planes x 1 layer x 1 head x 128 uint8 = 4 KiB).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from lmcache_svc.config import Config, load_config
from lmcache_svc.keys import ChunkKey, KVLayout, Namespace

if TYPE_CHECKING:
    from lmcache_svc.cache.tiered_cache import TieredCache

CHUNK_BYTES = 4096  # the chunk size of make_namespace() and the default size of make_chunk()


def make_layout(
    *,
    dtype: str = "uint8",
    num_layers: int = 1,
    num_kv_heads: int = 1,
    head_size: int = 128,
    block_size: int = 16,
    page_layout: str = "test",
) -> KVLayout:
    return KVLayout(dtype, num_layers, num_kv_heads, head_size, block_size, page_layout)


def make_namespace(
    *,
    model: str = "m",
    tenant: str = "default",
    chunk_size: int = 16,
    layout: KVLayout | None = None,
    **fields: int,
) -> Namespace:
    """A namespace of ``make_layout()`` (or ``layout``); ``fields`` sets e.g. ``tp_rank``."""
    layout = layout or make_layout()
    return Namespace(model=model, layout=layout, chunk_size=chunk_size, tenant=tenant, **fields)


def make_hash(seed: int | str) -> bytes:
    """A 32-byte chunk hash named by ``seed``."""
    return hashlib.sha256(str(seed).encode()).digest()


def make_key(i: int) -> ChunkKey:
    """A 48-byte chunk key whose first byte is ``i % 256`` (so a prefix pattern can pick it)."""
    return ChunkKey(bytes([i % 256]) + hashlib.sha384(f"chunk-{i}".encode()).digest()[1:])


def make_chunk(seed: int | str, nbytes: int = CHUNK_BYTES) -> bytes:
    """``nbytes`` of payload named by ``seed`` (different seeds differ in every 32-byte block)."""
    block = hashlib.sha256(f"payload-{seed}".encode()).digest()
    return (block * (nbytes // len(block) + 1))[:nbytes]


class ManualClock:
    """A monotonic clock the test moves by hand (``clock.now += seconds``)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def put_chunks(cache: TieredCache, namespace: Namespace, hashes: list[bytes]) -> list[bytes]:
    """Store chunk ``i`` of ``hashes`` under ``namespace``, ``chunk_bytes`` of byte ``i``;
    returns ``hashes``."""
    for i, digest in enumerate(hashes):
        cache.put(namespace.namespace_id, digest, bytes([i]) * namespace.chunk_bytes)
    return hashes


def in_process_config(**overrides: Any) -> Config:
    """The config of a server run in this process (``app.Service(config).run()``): a 4 MiB
    arena under a name of its own, no prefault, and no listener unless ``overrides`` (dotted
    keys, as ``load_config`` takes them) name one."""
    return load_config(
        env={},
        overrides={
            "cpu.capacity": "4MiB",
            "cpu.prefault": "off",
            "cpu.shm_name": f"lmcache-svc-test-{os.getpid()}-{secrets.token_hex(4)}",
            "socket": None,
            "http_port": None,
            "grpc_port": None,
            **overrides,
        },
    )


def address_of(buffer: Any) -> int:
    """Where a buffer's (a memoryview's, an array's) bytes start in this process."""
    array = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data)


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` if it never was in
    ``timeout_s`` (a bound on a hang, not a measurement: set it generously). The polls start
    1 ms apart and back off to 100 ms, so a predicate that asks a server does not load it."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.001
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.1)


def process_state(pid: int) -> str | None:
    """The process's state letter from ``/proc`` ("R", "S", "T" stopped, "Z" zombie...);
    ``None`` once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def child_pids(pid: int, named: bytes = b"") -> list[int]:
    """The live children of ``pid`` (any of its threads') whose command line holds ``named``."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(c) for c in (task / "children").read_text().split()]
            out += [c for c in kids if named in Path(f"/proc/{c}/cmdline").read_bytes()]
        except OSError:  # a thread or a child that just ended
            continue
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[tuple]:
    """Record each call of ``owner.name`` (a class's method, an object's bound method or a
    module's function; each call still runs): one entry per call, its positional arguments
    (after ``self`` for a class's method)."""
    calls: list[tuple] = []
    target = getattr(owner, name)
    is_method = isinstance(owner, type)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args[1:] if is_method else args)
        return target(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def count_socket_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record each ``connect``, ``recv``, ``recv_into`` and ``sendall`` of this process's
    sockets as ``(name, outcome)``, outcome ``"ok"``, ``"timeout"`` (a timeout was paid) or
    ``"error"``: how many times a client tried a server, and how many deadlines it waited out."""
    calls: list[tuple[str, str]] = []
    for name in ("connect", "recv", "recv_into", "sendall"):
        method = getattr(socket.socket, name)

        def counted(self: socket.socket, *args: Any, _name: str = name, _call: Any = method) -> Any:
            try:
                result = _call(self, *args)
            except TimeoutError:
                calls.append((_name, "timeout"))
                raise
            except OSError:
                calls.append((_name, "error"))
                raise
            calls.append((_name, "ok"))
            return result

        monkeypatch.setattr(socket.socket, name, counted)
    return calls


PLUGIN_DIR = Path(__file__).resolve().parents[1] / "connectors" / "vllm"


def import_plugin_from_source() -> None:
    """Let tests import the plugin's vLLM-free modules straight from ``connectors/vllm``
    (the test venv has torch but not vLLM); conftests call it before collection."""
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
