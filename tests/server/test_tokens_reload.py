"""Tokens-file reloads: every broken file keeps the previous tokens and is logged once, reloads
run off the caller's thread (never on the event loop), a burst of SIGHUPs costs at most two
reloads, and a revoked token's open sessions end (what they held is given back)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.server import tokens
from lmcache_svc.server.tokens import Authenticator
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_namespace, wait_until
from tests.server.test_tenants import ACME, ADMIN, BOB, TOKENS, _rewrite
from tests.server.test_tenants import tokens_file as tokens_file  # the fixture


def _non_utf8(path: Path) -> None:
    _rewrite(path, TOKENS)
    path.write_bytes(TOKENS.encode() + b"\n# caf\xe9\n")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _deep(path: Path) -> None:
    _rewrite(path, "tokens: " + "[" * 50_000 + "]" * 50_000)


BROKEN: dict[str, Callable[[Path], None]] = {
    "non-UTF-8": _non_utf8,
    "bad YAML": lambda p: _rewrite(p, "tokens: [unclosed"),
    "not a mapping": lambda p: _rewrite(p, "[1, 2, 3]"),
    "empty": lambda p: _rewrite(p, ""),
    "missing": lambda p: p.unlink(),
    "a directory": _directory,
    "deep nesting": _deep,
    "duplicate tokens": lambda p: _rewrite(p, TOKENS + f"  - tenant: c\n    token: {ACME}\n"),
    "bad entry": lambda p: _rewrite(p, TOKENS + "  - tenant: c\n    token: short\n"),
}


@pytest.mark.parametrize("breakage", list(BROKEN))
def test_every_broken_file_keeps_the_previous_tokens_and_is_logged_once(
    tokens_file: Path,
    breakage: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tokens, "RECHECK_S", 0.0)  # every request looks at the file
    auth = Authenticator(tokens_file=tokens_file)
    with caplog.at_level(logging.INFO):
        BROKEN[breakage](tokens_file)
        wait_until(
            lambda: (
                auth.authenticate(f"Bearer {ACME}").tenant == "acme"
                and "keeping the previous tokens" in caplog.text
            ),
            30,
            "the broken file reported",
        )
        for _ in range(200):  # more requests: the same tokens, no new log line
            assert auth.authenticate(f"Bearer {BOB}").tenant == "bob"
        auth.request_reload()  # a SIGHUP on the same broken file is reported again: once
        wait_until(
            lambda: caplog.text.count("keeping the previous tokens") == 2,
            30,
            "the second report of the bad file",
        )
        for _ in range(50):
            assert auth.authenticate(f"Bearer {ADMIN}").admin
    assert caplog.text.count("keeping the previous tokens") == 2, caplog.text
    for token in (ACME, BOB, ADMIN):
        assert token not in caplog.text


def test_reloads_run_off_the_callers_thread_and_a_burst_costs_two(
    tokens_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = Authenticator(tokens_file=tokens_file)
    calls: list[str] = []
    entered, release = threading.Event(), threading.Event()
    real = tokens.read_tokens_file

    def slow_read(path: Path) -> object:
        calls.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30)
        return real(path)

    monkeypatch.setattr(tokens, "read_tokens_file", slow_read)
    for _ in range(100):  # a burst of SIGHUPs: each returns at once
        auth.request_reload()
    assert entered.wait(30)
    assert len(calls) == 1 and calls[0] != threading.current_thread().name
    assert auth.authenticate(f"Bearer {ACME}").tenant == "acme"  # served meanwhile
    release.set()
    wait_until(lambda: auth.reloads == 2, 30, "the pending reload")
    time.sleep(0.2)  # nothing else is coming: no third reload starts
    assert len(calls) == 2 and auth.reloads == 2


@pytest.fixture
def big_tokens_server(tmp_path: Path) -> Iterator[tuple[ServerProc, Path]]:
    path = tmp_path / "tokens.yaml"
    many = "".join(f"  - tenant: t{i}\n    token: tenant-token-{i:08d}\n" for i in range(5000))
    path.write_text(TOKENS + many)
    proc = start_server(tmp_path, env={"LMCACHE_SVC_TOKENS_FILE": str(path)})
    yield proc, path
    proc.cleanup()


def test_sighups_never_stop_the_server_answering(
    big_tokens_server: tuple[ServerProc, Path],
) -> None:
    """Each reload of the 5,000-entry file takes seconds of pure Python (0.7 s with libyaml);
    on the event loop, as before, each SIGHUP stopped every call for that long."""
    server, _ = big_tokens_server
    ns = make_namespace(tenant="acme", chunk_size=256)
    with CacheClient(server.grpc, auth_token=ACME, timeout_s=2) as client:
        client.register_namespace(ns)
        for _ in range(10):  # a lookup right after each SIGHUP, within its 2 s deadline
            os.kill(server.proc.pid, signal.SIGHUP)
            assert client.lookup(ns.namespace_id, [b"\x01" * 32]).num_hit_chunks == 0
    wait_until(
        lambda: "loaded: 5004 tokens" in server.log_path.read_text(),
        30,
        "a reload of the 5004 tokens",
    )


def test_a_revoked_tokens_sessions_end_and_give_back_what_they_held(
    big_tokens_server: tuple[ServerProc, Path],
) -> None:
    server, path = big_tokens_server
    ns = make_namespace(tenant="acme", chunk_size=256)
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    with CacheClient(server.socket, auth_token=ADMIN, timeout_s=10) as admin:
        admin.register_namespace(ns)
        victim = CacheClient(server.socket, auth_token=ACME, timeout_s=10)
        victim.register_namespace(ns)
        victim.prepare_store(ns.namespace_id, hashes[:2])  # reserved, never committed
        assert admin.stats()["pending_stores"] == 2
        _rewrite(path, path.read_text().replace(f"token: {ACME}", "token: acme-rotated-000001"))
        os.kill(server.proc.pid, signal.SIGHUP)
        wait_until(lambda: admin.stats()["pending_stores"] == 0, 30, "the reservations given back")
        with pytest.raises(errors.Unauthenticated):
            victim.prepare_store(ns.namespace_id, hashes[2:])
        victim.close()
    assert "ended 1 session" in server.log_path.read_text()
