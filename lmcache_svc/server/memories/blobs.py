"""Where memory blobs live: in RAM, or in a directory that survives a restart.

Both hold bytes per (tenant, memory id) and know nothing of capacity or format; ``MemoryStore``
(``store.py``) decides. The directory layout is ``<path>/t-<tenant as hex>/<memory id>.safetensors``
(a tenant name never becomes a path component as is); a blob is written to ``<path>/tmp/``,
fsynced, and renamed into place, so a crash leaves either the old state or the new, never a
torn file. ``scan`` lists what a previous run left, reading only each file's header.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from lmcache_svc.errors import ConfigError, InvalidArgument, NoSpace, TierError
from lmcache_svc.memory_blob import MemoryInfo, header_length, parse_header

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_TENANT_PREFIX = "t-"


class Blobs(Protocol):
    def write(self, tenant: str, memory_id: str, blob: bytes) -> None: ...
    def read(self, tenant: str, memory_id: str) -> bytes | None: ...
    def remove(self, tenant: str, memory_id: str) -> None: ...
    def scan(self) -> Iterator[tuple[str, MemoryInfo]]: ...


class RamBlobs:
    """Blobs in this process's memory: gone when it exits."""

    def __init__(self) -> None:
        self._blobs: dict[tuple[str, str], bytes] = {}

    def write(self, tenant: str, memory_id: str, blob: bytes) -> None:
        self._blobs[tenant, memory_id] = blob

    def read(self, tenant: str, memory_id: str) -> bytes | None:
        return self._blobs.get((tenant, memory_id))

    def remove(self, tenant: str, memory_id: str) -> None:
        self._blobs.pop((tenant, memory_id), None)

    def scan(self) -> Iterator[tuple[str, MemoryInfo]]:
        return iter(())


class DirBlobs:
    """Blobs as files under ``path``, written temp + fsync + rename."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = path / "tmp"
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            leftovers = list(self._tmp.iterdir())
            for name in leftovers:
                name.unlink()
        except OSError as e:
            raise ConfigError(f"memory path {path} is not a writable directory: {e}") from None
        if leftovers:
            log.warning("memory path %s: removed %d unfinished writes", path, len(leftovers))

    def _file(self, tenant: str, memory_id: str) -> Path:
        return self.path / (_TENANT_PREFIX + tenant.encode().hex()) / (memory_id + SUFFIX)

    def write(self, tenant: str, memory_id: str, blob: bytes) -> None:
        final = self._file(tenant, memory_id)
        tmp = self._tmp / f"{memory_id}-{uuid.uuid4().hex}.tmp"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise NoSpace(f"no room for memory {memory_id}: {self.path} is full") from None
            raise TierError(f"cannot write memory {memory_id} under {self.path}: {e}") from None

    def read(self, tenant: str, memory_id: str) -> bytes | None:
        try:
            return self._file(tenant, memory_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TierError(f"cannot read memory {memory_id} under {self.path}: {e}") from None

    def remove(self, tenant: str, memory_id: str) -> None:
        file = self._file(tenant, memory_id)
        try:
            file.unlink(missing_ok=True)
            _fsync_dir(file.parent)
        except OSError as e:
            raise TierError(f"cannot delete memory {memory_id} under {self.path}: {e}") from None

    def scan(self) -> Iterator[tuple[str, MemoryInfo]]:
        for tenant_dir in sorted(self.path.glob(_TENANT_PREFIX + "*")):
            tenant = _tenant_of(tenant_dir.name)
            if tenant is None:
                log.warning("memory path: ignoring %s (not a tenant directory)", tenant_dir)
                continue
            for file in sorted(tenant_dir.glob("*" + SUFFIX)):
                info = _read_info(file)
                if info is not None:
                    yield tenant, info


def _tenant_of(dir_name: str) -> str | None:
    try:
        return bytes.fromhex(dir_name.removeprefix(_TENANT_PREFIX)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _read_info(file: Path) -> MemoryInfo | None:
    """The file's ``MemoryInfo`` from its header, or None (logged) if it is not a memory."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            head = prefix + f.read(header_length(prefix, size))
        info = parse_header(head, size)
    except (OSError, InvalidArgument) as e:
        log.warning("memory path: ignoring %s: %s", file, e)
        return None
    if file.name != info.memory_id + SUFFIX:
        log.warning("memory path: ignoring %s: it holds memory %s", file, info.memory_id)
        return None
    return info


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
