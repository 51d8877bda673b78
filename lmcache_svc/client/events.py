"""What a client tells the server about the chunks it stores, for the server's KV events,
and where the server announces them (docs/events.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EventsSource:
    """A namespace's event stream: ZMQ PUB endpoint and topic, replay/snapshot endpoint."""

    topic: str
    endpoint: str
    replay_endpoint: str | None


@dataclass(slots=True)
class ChunkTokens:
    """Per chunk hash: the hash of the chunk before it (``b""`` for a sequence's first)
    and its token ids as little-endian uint32 bytes."""

    items: dict[bytes, tuple[bytes, bytes]] = field(default_factory=dict)

    def add(self, chunk_hash: bytes, parent_hash: bytes, token_ids: bytes) -> None:
        self.items[bytes(chunk_hash)] = (bytes(parent_hash), bytes(token_ids))

    def for_chunks(self, chunk_hashes: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
        """``CommitStoreRequest.token_ids`` and ``parent_hashes`` for these chunks, in
        order; empty when any of them is not described (the server takes all or none)."""
        found = [self.items.get(bytes(h)) for h in chunk_hashes]
        if not found or any(f is None for f in found):
            return b"", []
        return b"".join(f[1] for f in found if f), [f[0] for f in found if f]
