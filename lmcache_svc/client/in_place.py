"""Loads without a lease: chunks read straight from the mapped arena, checked afterwards.

The server's lookup index (``shm.lookup_index``) says where each indexed chunk's bytes are
in the arena the session mapped. ``read_in_place`` locates every chunk of a load there and
hands out read-only views of their bytes, with no round trip; the caller copies them, then
asks ``InPlaceRead.unchanged``: how many leading chunks kept their index entries throughout
(the server removes an entry before it frees the slot, so those bytes were not rewritten
while they were read). Chunks past that number may have been overwritten: load them again
under a lease (``CacheClient.prepare_load``) or recompute them. Afterwards the caller tells
the server what it read (``CacheClient.touch``, off the request's path), so the chunks stay
recently used and the reads are counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_svc.client.session import Session
from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import Namespace
from lmcache_svc.results import Placement
from lmcache_svc.shm.index_reader import IndexReader, Located


@dataclass(frozen=True, slots=True)
class InPlaceRead:
    """Read-only views of the located chunks' bytes; copy them, then call ``unchanged``."""

    buffers: list[memoryview]
    reader: IndexReader
    located: Located

    @property
    def offsets(self) -> list[int]:
        """Where each view starts in the session's arena (chunks one after another there
        can be copied as one, told apart without asking each view for its address)."""
        return self.located.offsets

    def unchanged(self) -> int:
        """How many leading chunks were not freed or rewritten since they were located: the
        copies of those are good."""
        return self.reader.unchanged(self.located)


def read_in_place(
    session: Session | None,
    namespace: Namespace,
    chunk_hashes: Sequence[bytes],
    placement: Placement | None = None,
) -> InPlaceRead | None:
    """Views of every chunk's bytes in the session's arena, or None when any of them is not
    located there now (not indexed, in a lower tier, no mapping or table here, the table
    closed or busy, a location outside the mapping).

    ``placement``: where a lookup found these chunks moments ago (``LookupResult``), maybe
    in another process: used as it is when it is this session's table's, with no second
    read of the table (``IndexReader.placed``); ``unchanged`` checks it after the copy."""
    if session is None or not session.alive or session.mapping is None or not chunk_hashes:
        return None
    reader = session.indexes.get(namespace.tenant)
    if reader is None or any(len(h) != 32 for h in chunk_hashes):
        return None
    ns_id = namespace.namespace_id
    located = None if placement is None else reader.placed(ns_id, chunk_hashes, placement)
    if located is None:
        located = reader.locate(ns_id, chunk_hashes)
    if located is None:
        return None
    length = namespace.chunk_bytes
    try:
        views = [session.mapping.view(o, length, writable=False) for o in located.offsets]
    except (InvalidArgument, RuntimeError):  # not this mapping's range, or it was closed
        return None
    return InPlaceRead(views, reader, located)
