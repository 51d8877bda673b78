"""What the scheduler half tells the worker half each step: plain data only.

The scheduler decides *what* moves (which chunks, into or out of which KV blocks); the
worker does the copies. The plans hold only ints, bytes and strings so they pickle cheaply
and identically across the engine-core and worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_svc.results import Placement


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Copy the tail of a request's external hit from the server into its KV blocks.

    ``chunk_hashes[r]`` are tensor-parallel rank ``r``'s hashes of the chunks to read, in
    token order. The first chunk may be partly covered by vLLM's own prefix cache: only its
    blocks from ``first_block`` on are copied. ``block_ids`` are the destination blocks, one
    per block of the loaded range, in token order. ``placement``: where rank 0's chunks
    were in the server's arena when the scheduler's lookup read the shared index (the
    worker reads them there without reading the index again), if it did.
    """

    req_id: str
    chunk_hashes: tuple[tuple[bytes, ...], ...]
    first_block: int
    block_ids: tuple[int, ...]
    is_async: bool
    placement: Placement | None = None

    def hashes_for(self, tp_rank: int) -> tuple[bytes, ...]:
        return self.chunk_hashes[tp_rank]


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Copy full chunks that earlier steps computed from KV blocks to the server.

    ``block_ids`` holds ``blocks_per_chunk`` source blocks per chunk, in token order.
    ``token_ids`` (the chunks' tokens, little-endian uint32) and ``parent_hashes`` (per
    rank, the hash of the chunk before the first, ``b""`` for a prompt's first) are set when
    the server publishes KV events (``events.py``), else empty.
    """

    req_id: str
    chunk_hashes: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[int, ...]
    token_ids: bytes = b""
    parent_hashes: tuple[bytes, ...] = ()

    def hashes_for(self, tp_rank: int) -> tuple[bytes, ...]:
        return self.chunk_hashes[tp_rank]


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps for this step's saves: the worker reports
    them done (``finished_sending``) once their chunks are copied out, or given up."""
    starts_requests: bool = False
    """The step schedules new requests: it computes their first tokens (``FirstTokenHold``)."""

    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.held
