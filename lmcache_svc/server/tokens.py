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
one of ``tenant`` and ``admin: true``. The file is re-read when it changes (looked at, with
one ``stat``, at most once a second, on the next request) and on SIGHUP. A reload never
runs on the caller's thread (the event loop): it runs on a thread of its own, at most one at
a time, and requests that come meanwhile (a burst of SIGHUPs, a file changing again) are
merged into one more. Whatever is wrong with the file (missing, not a file, unreadable, not
UTF-8, not YAML/TOML, nested too deeply, a bad or repeated entry), the previous tokens stay
in force and it is logged once (once per change of the file, and once per SIGHUP), never
per request. A token that a reload removes, or whose tenant or rights change, is revoked:
the listeners (``on_revoke``: the gRPC servicer) end the sessions it opened. See
``docs/security.md`` for rotation.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
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
        digest = self.digest()
        if self.admin:
            return Principal(label="admin", tenant=None, admin=True, token_id=digest)
        return Principal(
            label=f"tenant {self.tenant!r}",
            tenant=self.tenant,
            read_only=self.read_only,
            token_id=digest,
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

    ``admin_token`` (the config's ``auth_token``) is fixed; the tokens file is read at
    construction (``ConfigError`` if it is bad: the server does not start) and re-read, in
    the background, when its modification time, size or inode changes and on
    ``request_reload``. Thread-safe.
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
        self._loaded: dict[bytes, Principal] = {}
        self._table = TokenTable(self._fixed)
        self._running = False
        self._pending = False
        self._listeners: list[Callable[[set[bytes]], object]] = []
        self.reloads = 0
        """Reloads finished (good or bad) since start-up, for tests and logs."""
        if tokens_file is not None:
            self.reload()

    def authenticate(self, header_value: str | None) -> Principal:
        token = bearer_token(header_value)
        self._maybe_reload()
        principal = self._table.find(token)
        if principal is None:
            raise Unauthenticated("invalid bearer token")
        return principal

    def on_revoke(self, listener: Callable[[set[bytes]], object]) -> None:
        """Call ``listener`` (from the reload's thread) with the ``token_id`` of every token a
        reload revoked."""
        self._listeners.append(listener)

    def reload(self) -> None:
        """Re-read the tokens file now, on this thread; ``ConfigError`` (old tokens kept) if
        it is bad. The server calls it once, at start-up; later reloads are
        ``request_reload``'s."""
        if self._path is None:
            return
        stamp = _stamp(self._path)
        try:
            table = read_tokens_file(self._path)
        except ConfigError:
            raise
        except Exception as e:  # anything else wrong with the file is a bad file too
            raise ConfigError(f"tokens file {self._path} cannot be read: {_reason(e)}") from None
        with self._lock:
            revoked = {d for d, p in self._loaded.items() if table.get(d) != p}
            self._loaded = table
            self._table = TokenTable({**table, **self._fixed})
            self._stamp = stamp
        log.info("tokens file %s loaded: %d tokens", self._path, len(table))
        if revoked:
            log.warning("tokens file %s: %d tokens revoked", self._path, len(revoked))
            for listener in self._listeners:
                try:
                    listener(revoked)
                except Exception:  # a bug there must not undo or misreport the reload
                    log.exception("ending the sessions of revoked tokens failed")

    def request_reload(self) -> None:
        """Re-read the file soon, on a thread of its own (SIGHUP). Never blocks: while a
        reload runs, any number of requests make one more reload after it."""
        if self._path is None:
            return
        with self._lock:
            if self._running:
                self._pending = True
                return
            self._running = True
        threading.Thread(target=self._reload_loop, name="lmcache-svc-tokens", daemon=True).start()

    def _reload_loop(self) -> None:
        assert self._path is not None
        while True:
            stamp = _stamp(self._path)
            try:
                self.reload()
            except Exception as e:  # the old tokens stay; said once per request or change
                with self._lock:
                    self._stamp = stamp  # not looked at again until it changes
                log.error("keeping the previous tokens: %s", e)
            with self._lock:
                self.reloads += 1
                if not self._pending:
                    self._running = False
                    return
                self._pending = False

    def _maybe_reload(self) -> None:
        """At most once a ``RECHECK_S``: one ``stat``, and a reload requested if the file
        changed (a broken file is not looked at again until it changes)."""
        now = time.monotonic()
        if self._path is None or now < self._next_check:
            return
        self._next_check = now + RECHECK_S
        if _stamp(self._path) != self._stamp:
            with self._lock:
                if self._running:  # that reload will see the change (or report it)
                    return
            self.request_reload()


def _reason(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "it is nested too deeply"
    return f"{type(error).__name__}: {error}"


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
