"""The bytes a stored memory is served with are the bytes it was stored with.

A memory's xxh3-64 (``blob_checksum``) is taken when it is stored and kept with it (in its
file's name, ``blobs.py``). A read (``MemoryRead``) makes two passes over the stored bytes,
one piece at a time, so it never holds more than a piece: ``verify`` hashes them all before
anything is sent, so a memory that changed at rest (a bit flipped on disk, a file edited or
truncated) is refused with ``MemoryCorrupted`` and a clear message instead of being served;
``pieces`` then hashes again what it hands out and raises ``MemoryCorrupted`` at the end if
those bytes differ after all (changed between the passes), so a transport that streams
them ends the response with an error, never as a success. Either way the store is told
(``on_mismatch``: it quarantines the file and counts it).

xxh3-64 catches corruption, not forgery: whoever can rewrite the file can rename it too
(docs/security.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import BinaryIO

import xxhash

from lmcache_svc.errors import MemoryCorrupted
from lmcache_svc.memory_blob import MemoryInfo
from lmcache_svc.tiers.base import Buffer

CHECK_PIECE_BYTES = 1 << 20
"""Piece size of the verifying pass (and of checksums taken from files)."""


def blob_checksum(blob: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(blob)


def file_checksum(file: BinaryIO) -> tuple[int, int]:
    """(xxh3-64, bytes) of what is left to read in ``file``, read a piece at a time."""
    digest = xxhash.xxh3_64()
    num = 0
    while piece := file.read(CHECK_PIECE_BYTES):
        digest.update(piece)
        num += len(piece)
    return digest.intdigest(), num


class MemoryRead:
    """One read of a stored memory: ``verify``, then ``pieces``; ``close`` when done (it
    closes the file and gives back the store's transfer slot: ``release``). ``close`` may
    come from another thread than the reads: it waits for a read in progress, so the file
    is never closed under one."""

    def __init__(
        self,
        file: BinaryIO,
        info: MemoryInfo,
        checksum: int,
        *,
        on_mismatch: Callable[[], str],
        release: Callable[[], None],
    ) -> None:
        self.info = info
        self.size = info.size_bytes
        self._file = file
        self._checksum = checksum
        self._on_mismatch = on_mismatch
        self._release: Callable[[], None] | None = release
        self._io = threading.Lock()

    def verify(self) -> None:
        """Hash every stored byte; ``MemoryCorrupted`` (after quarantine) if they changed."""
        with self._io:
            self._file.seek(0)
            value, num = file_checksum(self._file)
        if (value, num) != (self._checksum, self.size):
            self._fail()

    def pieces(self, piece_bytes: int) -> Iterator[bytes]:
        """The stored bytes in pieces of at most ``piece_bytes``, hashed again on the way:
        ``MemoryCorrupted`` if they are not the bytes stored, raised before the last piece is
        handed out (each piece is held until the next is read), so a response never
        completes with changed bytes, even a memory of one piece."""
        digest = xxhash.xxh3_64()
        num = 0
        held: bytes | None = None
        while piece := self._read(num, min(piece_bytes, self.size - num) or 1):
            digest.update(piece)
            num += len(piece)
            if num > self.size:
                break
            if held is not None:
                yield held
            held = piece
        if (digest.intdigest(), num) != (self._checksum, self.size):
            self._fail()
        if held is not None:
            yield held

    def _read(self, offset: int, num: int) -> bytes:
        with self._io:
            if self._release is None:
                raise ValueError("read of a closed MemoryRead")
            self._file.seek(offset)
            return self._file.read(num)

    def _fail(self) -> None:
        where = self._on_mismatch()
        raise MemoryCorrupted(
            f"memory {self.info.memory_id} differs from the checksum recorded when it was "
            f"stored (its bytes changed at rest); it is not served: {where}; store it again"
        )

    def close(self) -> None:
        """Idempotent."""
        with self._io:
            release, self._release = self._release, None
            if release is None:
                return
            try:
                self._file.close()
            finally:
                release()

    def __enter__(self) -> MemoryRead:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
