"""Where memory blobs live: in RAM, or in a directory that survives a restart.

Both hold bytes per (tenant, memory id) with the checksum taken when they were stored
(``integrity.py``), and know nothing of capacity or format; ``MemoryStore`` (``store.py``)
decides. The directory layout is
``<path>/t-<tenant as hex>/<memory id>.<xxh3-64 as 16 hex>.safetensors`` (a tenant name never
becomes a path component as is): the checksum is part of the name, so it is written in the
same atomic rename as the bytes and can never disagree with them after a crash. A blob is
written to ``<path>/tmp/``, fsynced, and renamed into place (then the directory fsynced),
so a crash leaves either the old state or the new, never a torn file. A file that fails its
checksum is moved to ``<path>/quarantine/t-<tenant as hex>/`` (kept for inspection, never
scanned again). ``scan.py`` lists what a previous run left.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Protocol

from lmcache_svc.errors import ConfigError, NoSpace, TierError
from lmcache_svc.server.memories.scan import Found, fsync_dir, scan_dir
from lmcache_svc.tiers.base import Buffer

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TENANT_PREFIX = "t-"
QUARANTINE_DIR = "quarantine"


class Blobs(Protocol):
    def write(self, tenant: str, memory_id: str, blob: Buffer, checksum: int) -> None: ...
    def open(self, tenant: str, memory_id: str, checksum: int) -> BinaryIO | None: ...
    def remove(self, tenant: str, memory_id: str, checksum: int) -> None: ...
    def quarantine(self, tenant: str, memory_id: str, checksum: int) -> str: ...
    def scan(self) -> list[Found]: ...

    @property
    def num_skipped(self) -> int:
        """Files a scan found that are not memories (reported, left in place)."""


class RamBlobs:
    """Blobs in this process's memory: gone when it exits."""

    num_skipped = 0

    def __init__(self) -> None:
        self._blobs: dict[tuple[str, str], bytes] = {}

    def write(self, tenant: str, memory_id: str, blob: Buffer, checksum: int) -> None:
        self._blobs[tenant, memory_id] = bytes(blob)

    def open(self, tenant: str, memory_id: str, checksum: int) -> BinaryIO | None:
        blob = self._blobs.get((tenant, memory_id))
        return None if blob is None else io.BytesIO(blob)  # shares the bytes, no copy

    def remove(self, tenant: str, memory_id: str, checksum: int) -> None:
        self._blobs.pop((tenant, memory_id), None)

    def quarantine(self, tenant: str, memory_id: str, checksum: int) -> str:
        self.remove(tenant, memory_id, checksum)
        return "it was dropped from memory"

    def scan(self) -> list[Found]:
        return []


class DirBlobs:
    """Blobs as files under ``path``, written temp + fsync + rename."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = path / "tmp"
        self.num_skipped = 0
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            leftovers = list(self._tmp.iterdir())
            for name in leftovers:
                name.unlink()
        except OSError as e:
            raise ConfigError(f"memory path {path} is not a writable directory: {e}") from None
        if leftovers:
            log.warning("memory path %s: removed %d unfinished writes", path, len(leftovers))

    def _dir(self, tenant: str) -> Path:
        return self.path / (TENANT_PREFIX + tenant.encode().hex())

    def _file(self, tenant: str, memory_id: str, checksum: int) -> Path:
        return self._dir(tenant) / f"{memory_id}.{checksum:016x}{SUFFIX}"

    def write(self, tenant: str, memory_id: str, blob: Buffer, checksum: int) -> None:
        final = self._file(tenant, memory_id, checksum)
        tmp = self._tmp / f"{memory_id}-{uuid.uuid4().hex}.tmp"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise NoSpace(f"no room for memory {memory_id}: {self.path} is full") from None
            raise TierError(f"cannot write memory {memory_id} under {self.path}: {e}") from None

    def open(self, tenant: str, memory_id: str, checksum: int) -> BinaryIO | None:
        try:
            return open(self._file(tenant, memory_id, checksum), "rb", buffering=0)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierError(f"cannot read memory {memory_id} under {self.path}: {e}") from None

    def remove(self, tenant: str, memory_id: str, checksum: int) -> None:
        file = self._file(tenant, memory_id, checksum)
        try:
            file.unlink(missing_ok=True)
            fsync_dir(file.parent)
        except OSError as e:
            raise TierError(f"cannot delete memory {memory_id} under {self.path}: {e}") from None

    def quarantine(self, tenant: str, memory_id: str, checksum: int) -> str:
        file = self._file(tenant, memory_id, checksum)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest = self.path / QUARANTINE_DIR / file.parent.name / f"{file.name}.{stamp}"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, dest)
        except FileNotFoundError:
            return "its file was already gone"
        except OSError as e:
            log.error("memory %s: cannot move %s aside (%s); removing it", memory_id, file, e)
            file.unlink(missing_ok=True)
            return f"its file {file} was removed (it could not be moved aside: {e})"
        return f"its file was moved to {dest}"

    def scan(self) -> list[Found]:
        found = scan_dir(self.path, TENANT_PREFIX, SUFFIX, self._file)
        self.num_skipped = found.num_skipped
        return found.memories
