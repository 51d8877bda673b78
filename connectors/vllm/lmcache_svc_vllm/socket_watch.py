"""Whether the server's Unix socket file was replaced: a restarted server binds a new one.

``ServerLink`` asks while it waits out a back-off, so that a server restarted on the same
socket is tried soon after it is up, not at the end of a back-off of up to 30 s.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lmcache_svc.client.transport import RECONNECT_OPTIONS, grpc_target

SOCKET_CHECK_INTERVAL_S = 0.25
# While the server is down the client's gRPC channel retries its connection every
# max_reconnect_backoff (jittered by up to 20%) and fails calls at once in between, with the
# old error: a try as soon as a new socket file is seen was refused that way (tests). So
# the try waits for the channel's next attempt, and a little longer for it to connect.
RECONNECT_GRACE_S = 1.5 * dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000


class SocketWatch:
    """Whether the server's Unix socket file was replaced since the link last looked.

    A file is told by its device, inode and change time: on ext4 a restarted server's file
    got the inode number the old one freed, every time, but not its change time (set when
    the file is bound). It looks at most every ``SOCKET_CHECK_INTERVAL_S`` (a dead server
    costs at most one ``os.stat`` per call); a file it cannot stat counts as missing, and a
    missing file is never "replaced". Not locked, like the back-off: threads that race here
    cost at most one more early try."""

    __slots__ = ("path", "_clock", "_seen", "_checked_at")

    def __init__(self, path: str, *, clock: Callable[[], float]) -> None:
        self.path = path
        self._clock = clock
        self._seen: tuple[int, int, int] | None = None
        self._checked_at = float("-inf")

    def record(self) -> None:
        """A call failed: the file there now (or none) is the one that failed."""
        self._seen = self._identity()
        self._checked_at = self._clock()

    def replaced(self) -> bool:
        """Whether a file other than the one last seen is there now. Each new file counts
        once: from then on it is the one seen."""
        now = self._clock()
        if now - self._checked_at < SOCKET_CHECK_INTERVAL_S:
            return False
        self._checked_at = now
        seen, self._seen = self._seen, self._identity()
        return self._seen is not None and self._seen != seen

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_ctime_ns


def socket_path(address: str) -> str | None:
    """The file of a Unix socket address (``/p.sock``, ``unix:/p.sock``, ``unix:///p.sock``);
    None for ``unix-abstract:`` and ``host:port``, which have none."""
    target = grpc_target(address)  # the client checked it already
    if not target.startswith("unix:"):
        return None
    path = target.removeprefix("unix:")
    return path.removeprefix("//") if path.startswith("///") else path
