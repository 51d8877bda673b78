"""Who is calling: bearer tokens mapped to principals, shared by the HTTP and gRPC transports.

A token belongs to one tenant (it may only name that tenant's namespaces) or is an admin
token (any tenant, plus stats, metrics and the API docs). Tokens come from the config's
``auth_token`` (an admin token) and from a tokens file (``tokens.py``); ``Authenticator``
holds both and re-reads the file when it changes. Only SHA-256 digests of tokens are kept,
compared in constant time; tokens are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from lmcache_svc.errors import PermissionDenied, Unauthenticated, UnknownNamespace
from lmcache_svc.keys import Namespace

_SCHEME = "bearer"


@dataclass(frozen=True, slots=True)
class Principal:
    """What a token may do. ``tenant`` None: every tenant (admin tokens, authentication off)."""

    label: str
    """Names the principal in logs and errors ("admin", "tenant 'acme'"), never the token."""
    tenant: str | None
    admin: bool = False
    read_only: bool = False
    token_id: bytes | None = field(default=None, compare=False, repr=False)
    """The SHA-256 of the token from the tokens file that this principal came from (None for
    the config's ``auth_token`` and with authentication off): its sessions end when a reload
    revokes it."""

    def may_use(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant

    def check_register(self, namespace: Namespace) -> None:
        """Refuse to register (or hash keys for) a namespace of another tenant."""
        if not self.may_use(namespace.tenant):
            raise PermissionDenied(
                f"this token belongs to tenant {self.tenant!r}; it cannot use namespaces of "
                f"tenant {namespace.tenant!r} (set the namespace's tenant to {self.tenant!r})"
            )

    def check_namespace(self, namespace: Namespace) -> Namespace:
        """``namespace`` if this principal may use it; else the error of an unregistered id,
        so a token cannot tell another tenant's namespace from one that does not exist."""
        if not self.may_use(namespace.tenant):
            raise unknown_namespace(namespace.namespace_id)
        return namespace

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{what} needs an admin token; this is {self.label}'s")

    def check_write(self, what: str) -> None:
        if self.read_only:
            raise PermissionDenied(
                f"{what} needs a token that may write; {self.label}'s is read-only"
            )


OPEN = Principal(label="anyone (authentication is off)", tenant=None, admin=True)
ADMIN = Principal(label="admin", tenant=None, admin=True)


def unknown_namespace(namespace_id: bytes) -> UnknownNamespace:
    """The cache's error for an unregistered namespace id, word for word."""
    return UnknownNamespace(f"namespace {namespace_id.hex()} is not registered; register it first")


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenTable:
    """Token digests and their principals; lookup is constant-time in the token's bytes."""

    def __init__(self, entries: dict[bytes, Principal]) -> None:
        self._entries = list(entries.items())

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, token: str) -> Principal | None:
        digest = token_digest(token)
        found: Principal | None = None
        for known, principal in self._entries:  # no early exit: the time does not depend on
            if hmac.compare_digest(known, digest):  # which entry matched
                found = principal
        return found


def bearer_token(header_value: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ``Unauthenticated``."""
    if not header_value:
        raise Unauthenticated("missing 'Authorization: Bearer <token>' header")
    scheme, _, presented = header_value.strip().partition(" ")
    if scheme.lower() != _SCHEME or not presented.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return presented.strip()


def check_bearer(header_value: str | None, token: str | None) -> None:
    """Raise ``Unauthenticated`` unless ``header_value`` is ``Bearer <token>``.

    ``None`` as the token means authentication is off. Constant-time comparison.
    """
    if token is None:
        return
    presented = bearer_token(header_value)
    if not hmac.compare_digest(presented.encode("utf-8"), token.encode("utf-8")):
        raise Unauthenticated("invalid bearer token")
