"""The session streams open on the gRPC server, by the token that opened them.

A session ends when its client goes away, when the server stops (``end_all``), or when a
tokens-file reload revokes the token that opened it (``revoke``, called from the reload's
thread): its ``OpenSession`` stream then ends with ``UNAUTHENTICATED`` and the cache takes
back what the session held (leases, reservations, quarantined slots, store-pool slots), as
for a client that died. The client sees its session end: it stops answering lookups from
the index tables the session named, and a new session needs a valid token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenSession:
    ended: asyncio.Event
    loop: asyncio.AbstractEventLoop
    revoked: bool = False

    def end(self, revoked: bool) -> None:
        """From any thread."""
        self.revoked = self.revoked or revoked
        self.loop.call_soon_threadsafe(self.ended.set)


class OpenSessions:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_token: dict[bytes | None, dict[str, OpenSession]] = {}
        self._stopped = False

    def add(self, token_id: bytes | None, session_id: str) -> OpenSession:
        """A session just opened (on the event loop) by the token ``token_id`` (None: not a
        token of the tokens file)."""
        opened = OpenSession(asyncio.Event(), asyncio.get_running_loop())
        with self._lock:
            self._by_token.setdefault(token_id, {})[session_id] = opened
            if self._stopped:
                opened.ended.set()
        return opened

    def remove(self, token_id: bytes | None, session_id: str) -> None:
        with self._lock:
            sessions = self._by_token.get(token_id, {})
            sessions.pop(session_id, None)
            if not sessions:
                self._by_token.pop(token_id, None)

    def revoke(self, token_ids: set[bytes]) -> int:
        """End every session opened by one of ``token_ids``; how many there were."""
        with self._lock:
            ending = [s for t in token_ids for s in self._by_token.get(t, {}).values()]
        for opened in ending:
            opened.end(revoked=True)
        if ending:
            log.warning("%d tokens revoked: ended %d sessions they opened", len(token_ids),
                        len(ending))  # fmt: skip
        return len(ending)

    def end_all(self) -> None:
        """The server stops: end every session, and any opened from now on."""
        with self._lock:
            self._stopped = True
            ending = [s for sessions in self._by_token.values() for s in sessions.values()]
        for opened in ending:
            opened.end(revoked=False)
