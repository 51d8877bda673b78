"""Defaults shared by the server and its clients (no server dependencies here)."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> Path:
    """The gRPC Unix socket both sides use unless told otherwise."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"lmcache-svc-{os.getuid()}" / "grpc.sock"
