"""The tokens file (per-tenant credentials) and the ``Authenticator`` that serves it.

The file is YAML (or TOML when it ends in ``.toml``)::

    tokens:
      - tenant: acme                 # this token may only use namespaces of tenant "acme"
        token: "acme-engine-token-0001"
      - tenant: acme
        sha256: "9f86d0...0f00a08"   # the token's SHA-256 in hex: the file need not hold it
        read_only: true              # may look up and load, not store or delete
      - admin: true                  # every tenant, plus stats, metrics and /docs
        token: "ops-token-000000001"

Each entry has exactly one of ``token`` (at least 16 characters) and ``sha256``, and exactly
one of ``tenant`` and ``admin: true``. The file is re-read when it changes (checked at most
once a second, on the next request) and on SIGHUP; a file that fails to parse is logged and
the previous tokens stay in force. See ``docs/security.md`` for rotation.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lmcache_svc.config import format_validation_error, read_config_file
from lmcache_svc.errors import ConfigError, Unauthenticated
from lmcache_svc.server.auth import (
    ADMIN,
    OPEN,
    Principal,
    TokenTable,
    bearer_token,
    token_digest,
)

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
RECHECK_S = 1.0
"""How often a request may trigger a look at the file's modification time."""
_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


class TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str | None = Field(None, min_length=MIN_TOKEN_CHARS)
    sha256: str | None = None
    tenant: str | None = Field(None, min_length=1, max_length=256)
    admin: Literal[True] | None = None
    read_only: bool = False

    @model_validator(mode="after")
    def _check(self) -> TokenEntry:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError("give exactly one of 'token' and 'sha256'")
        if self.sha256 is not None and not _SHA256_HEX.match(self.sha256):
            raise ValueError("sha256 must be 64 hex characters (the token's SHA-256)")
        if (self.tenant is None) == (self.admin is None):
            raise ValueError("give exactly one of 'tenant' and 'admin: true'")
        if self.admin and self.read_only:
            raise ValueError("an admin token cannot be read_only")
        return self

    def digest(self) -> bytes:
        return (
            token_digest(self.token) if self.token is not None else bytes.fromhex(self.sha256 or "")
        )

    def principal(self) -> Principal:
        if self.admin:
            return ADMIN
        return Principal(
            label=f"tenant {self.tenant!r}", tenant=self.tenant, read_only=self.read_only
        )


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry] = Field(min_length=1)


def read_tokens_file(path: Path) -> dict[bytes, Principal]:
    """Digest -> principal of every entry; ``ConfigError`` naming the problem."""
    if not path.is_file():
        raise ConfigError(f"tokens file {path} does not exist or is not a file")
    data = read_config_file(path)
    try:
        parsed = TokensFile.model_validate(data)
    except ValidationError as e:
        problems = format_validation_error(e).split("\n")[1:]  # not "invalid configuration"
        raise ConfigError(f"tokens file {path} is invalid:\n" + "\n".join(problems)) from None
    table: dict[bytes, Principal] = {}
    for i, entry in enumerate(parsed.tokens):
        digest = entry.digest()
        if digest in table:
            raise ConfigError(f"tokens file {path}: tokens[{i}] repeats an earlier token")
        table[digest] = entry.principal()
    return table


class Authenticator:
    """Maps an ``Authorization`` header to a ``Principal``.

    ``admin_token`` (the config's ``auth_token``) is fixed; the tokens file is re-read when
    its modification time, size or inode changes. Thread-safe.
    """

    def __init__(self, *, admin_token: str | None = None, tokens_file: Path | None = None) -> None:
        if admin_token is None and tokens_file is None:
            raise ConfigError("an authenticator needs an admin token or a tokens file")
        self._fixed: dict[bytes, Principal] = {}
        if admin_token is not None:
            self._fixed[token_digest(admin_token)] = ADMIN
        self._path = tokens_file
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._table = TokenTable(self._fixed)
        if tokens_file is not None:
            self.reload()

    def authenticate(self, header_value: str | None) -> Principal:
        token = bearer_token(header_value)
        self._maybe_reload()
        principal = self._table.find(token)
        if principal is None:
            raise Unauthenticated("invalid bearer token")
        return principal

    def reload(self) -> None:
        """Re-read the tokens file now; ``ConfigError`` (old tokens kept) if it is bad."""
        if self._path is None:
            return
        with self._lock:
            stamp = _stamp(self._path)
            table = read_tokens_file(self._path)
            self._table = TokenTable({**table, **self._fixed})
            self._stamp = stamp
        log.info("tokens file %s loaded: %d tokens", self._path, len(table))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self._path is None or now < self._next_check:
            return
        self._next_check = now + RECHECK_S
        stamp = _stamp(self._path)
        if stamp == self._stamp:
            return
        try:
            self.reload()
        except ConfigError as e:
            self._stamp = stamp  # log once per change, not once a second
            log.error("keeping the previous tokens: %s", e)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def make_authenticator(
    auth_token: str | None, tokens_file: Path | None = None
) -> Authenticator | None:
    """None when neither is set: authentication is off."""
    if auth_token is None and tokens_file is None:
        return None
    return Authenticator(admin_token=auth_token, tokens_file=tokens_file)


def principal_of(auth: Authenticator | None, header_value: str | None) -> Principal:
    return OPEN if auth is None else auth.authenticate(header_value)
