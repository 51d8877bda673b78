"""SizeLedger: per-chunk sizes counted against a capacity."""

from __future__ import annotations

from lmcache_svc.keys import ChunkKey
from lmcache_svc.tiers.ledger import SizeLedger

A = ChunkKey(b"a" * 48)
B = ChunkKey(b"b" * 48)


def test_reserve_counts_and_refuses_over_capacity() -> None:
    ledger = SizeLedger(100)
    assert ledger.reserve(A, 60) == (True, None)
    assert ledger.reserve(B, 50) == (False, None)
    assert (ledger.used_bytes, ledger.num_chunks) == (60, 1)
    assert ledger.reserve(A, 90) == (True, 60)  # a replacement only counts the difference
    assert ledger.used_bytes == 90


def test_unreserve_restores_unless_changed_meanwhile() -> None:
    ledger = SizeLedger(100)
    ledger.reserve(A, 10)
    fits, old = ledger.reserve(A, 30)
    assert fits and old == 10
    ledger.unreserve(A, 30, old)
    assert (ledger.used_bytes, ledger.num_chunks) == (10, 1)
    ledger.reserve(B, 20)
    ledger.record(B, 25)  # a newer size: the stale unreserve must not undo it
    ledger.unreserve(B, 20, None)
    assert ledger.used_bytes == 35
    ledger.unreserve(B, 25, None)
    assert (ledger.used_bytes, ledger.num_chunks) == (10, 1)


def test_record_and_drop() -> None:
    ledger = SizeLedger(10)
    ledger.record(A, 50)  # found on the medium: counted even over capacity
    assert ledger.used_bytes == 50
    assert ledger.reserve(B, 1) == (False, None)
    ledger.drop(A)
    ledger.drop(A)
    assert (ledger.used_bytes, ledger.num_chunks) == (0, 0)
