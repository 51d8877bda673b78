"""What a restart finds in a memory directory: every memory a previous run left, with its
checksum; every other file reported and skipped, never a reason not to start.

A file is read only as far as its header (at most ``format.MAX_HEADER_BYTES``, parsed with
bounded work), so a scan costs little per memory. A file that is not a memory (garbage, a
truncated write from outside the store, a hostile header, a name that is not
``<memory id>.<checksum>.safetensors`` or holds another id) is logged with the reason and
left where it is; ``num_skipped`` counts them (exported as a metric). Files written before
checksums were recorded (``<memory id>.safetensors``) get theirs now: the whole file is
hashed once, a piece at a time, and renamed to carry it. Those bytes are trusted as they
are found then (nothing older to check them against).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_svc.memory_blob import (
    PREFIX_BYTES,
    MemoryInfo,
    check_memory_id,
    header_length,
    parse_header,
)
from lmcache_svc.server.memories.integrity import file_checksum

log = logging.getLogger(__name__)

FileOf = Callable[[str, str, int], Path]
"""(tenant, memory id, checksum) -> the file's path in the current layout."""


@dataclass(frozen=True, slots=True)
class Found:
    tenant: str
    info: MemoryInfo
    checksum: int


@dataclass(slots=True)
class ScanResult:
    memories: list[Found] = field(default_factory=list)
    num_skipped: int = 0
    num_upgraded: int = 0


class NotAMemory(Exception):
    """Why a file found by the scan is skipped."""


def scan_dir(path: Path, tenant_prefix: str, suffix: str, file_of: FileOf) -> ScanResult:
    result = ScanResult()
    seen: set[tuple[str, str]] = set()
    for tenant_dir in sorted(path.glob(tenant_prefix + "*")):
        tenant = _tenant_of(tenant_dir.name, tenant_prefix)
        if tenant is None:
            log.warning("memory path: ignoring %s (not a tenant directory)", tenant_dir)
            continue
        upgraded = result.num_upgraded
        for file in sorted(tenant_dir.glob("*" + suffix)):
            try:
                found = _read(tenant, file, suffix, file_of, result)
                if (tenant, found.info.memory_id) in seen:
                    raise NotAMemory(f"memory {found.info.memory_id} was found in another file")
            except Exception as e:  # a bad file is skipped, whatever is wrong with it
                log.warning("memory path: ignoring %s: %s", file, _reason(e))
                result.num_skipped += 1
                continue
            seen.add((tenant, found.info.memory_id))
            result.memories.append(found)
        if result.num_upgraded != upgraded:
            fsync_dir(tenant_dir)  # the renames that recorded checksums
    if result.num_upgraded:
        log.info("memory path %s: recorded the checksums of %d memories", path, result.num_upgraded)
    if result.num_skipped:
        log.warning("memory path %s: %d files are not memories (left in place)", path,
                    result.num_skipped)  # fmt: skip
    return result


def _reason(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "its header is nested too deeply"
    return str(error) or type(error).__name__


def _read(tenant: str, file: Path, suffix: str, file_of: FileOf, result: ScanResult) -> Found:
    name_id, _, name_sum = file.name.removesuffix(suffix).partition(".")
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(PREFIX_BYTES)
        head = prefix + f.read(header_length(prefix, size))
        info = parse_header(head, size)
        if name_id != info.memory_id:
            raise NotAMemory(f"it holds memory {info.memory_id}")
        check_memory_id(name_id)
        if name_sum:
            return Found(tenant, info, _parse_checksum(name_sum))
        f.seek(0)
        checksum, _ = file_checksum(f)
    os.replace(file, file_of(tenant, info.memory_id, checksum))  # an earlier version's file
    result.num_upgraded += 1
    return Found(tenant, info, checksum)


def _parse_checksum(text: str) -> int:
    if len(text) != 16 or text.strip("0123456789abcdef"):
        raise NotAMemory(f"{text!r} in its name is not a checksum (16 lowercase hex digits)")
    return int(text, 16)


def _tenant_of(dir_name: str, prefix: str) -> str | None:
    try:
        return bytes.fromhex(dir_name.removeprefix(prefix)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
