"""Which tenant a request acts for: the one place both transports ask.

Memories (and, later, everything else tenant-scoped) belong to the caller's tenant. Today
the server has a single bearer token and no tenants, so every caller is ``DEFAULT_TENANT``
(the same name a namespace gets when it names none). Per-tenant tokens plug in here: map the
presented token to its tenant.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_TENANT = "default"


def caller_tenant(authorization: str | None) -> str:
    """The tenant of a caller that sent this ``Authorization`` header (already checked)."""
    return DEFAULT_TENANT


def grpc_caller_tenant(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    value = dict(metadata or ()).get("authorization")
    return caller_tenant(value if isinstance(value, str) else None)
