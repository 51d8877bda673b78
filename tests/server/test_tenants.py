"""Per-tenant credentials: the tokens file, its reload, and tenant walls on REST and gRPC.

REST runs the app in uvicorn in a thread (the ``serve_http`` fixture); gRPC a real server
process (``bench.procs.start_server``) given the tokens file through the environment.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lmcache_svc import errors
from lmcache_svc.client import CacheClient
from lmcache_svc.config import load_config
from lmcache_svc.errors import ConfigError, Unauthenticated
from lmcache_svc.keys import Namespace, chunk_hashes
from lmcache_svc.server.tokens import RECHECK_S, Authenticator, read_tokens_file
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import make_chunk, make_namespace, wait_until
from tests.server.rest import Served
from tests.server.test_http import assert_error

ACME = "acme-token-00000001"
ACME_READER = "acme-reader-0000001"
BOB = "bob-token-000000001"
ADMIN = "ops-token-000000001"
TOKENS = f"""
tokens:
  - tenant: acme
    token: {ACME}
  - tenant: acme
    token: {ACME_READER}
    read_only: true
  - tenant: bob
    sha256: {hashlib.sha256(BOB.encode()).hexdigest()}
  - admin: true
    token: {ADMIN}
"""


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(TOKENS)
    return path


# -- the tokens file and the authenticator ----------------------------------------------------


def test_tokens_file_maps_each_token_to_its_tenant(tokens_file: Path) -> None:
    auth = Authenticator(tokens_file=tokens_file)
    acme = auth.authenticate(f"Bearer {ACME}")
    assert (acme.tenant, acme.admin, acme.read_only) == ("acme", False, False)
    assert auth.authenticate(f"Bearer {ACME_READER}").read_only
    assert auth.authenticate(f"Bearer {BOB}").tenant == "bob"  # given by its SHA-256 only
    admin = auth.authenticate(f"bearer {ADMIN}")
    assert admin.admin and admin.tenant is None
    for header in (None, "", f"Basic {ACME}", "Bearer ", f"Bearer {ACME}x", ACME):
        with pytest.raises(Unauthenticated):
            auth.authenticate(header)


def test_config_auth_token_is_an_admin_token_beside_the_file(tokens_file: Path) -> None:
    auth = Authenticator(admin_token="legacy-token-0000001", tokens_file=tokens_file)
    assert auth.authenticate("Bearer legacy-token-0000001").admin
    assert auth.authenticate(f"Bearer {ACME}").tenant == "acme"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tokens: []", "tokens"),
        ("tokens:\n  - tenant: a\n    token: short", "at least 16"),
        ("tokens:\n  - token: aaaaaaaaaaaaaaaaaaaa", "exactly one of 'tenant' and 'admin"),
        ("tokens:\n  - tenant: a\n    admin: true\n    token: aaaaaaaaaaaaaaaaaa", "exactly one"),
        ("tokens:\n  - tenant: a", "exactly one of 'token' and 'sha256'"),
        ("tokens:\n  - tenant: a\n    sha256: abc", "64 hex"),
        ("tokens:\n  - admin: true\n    read_only: true\n    token: aaaaaaaaaaaaaaaaaa", "admin"),
        ("tokens:\n  - tenant: a\n    token: aaaaaaaaaaaaaaaaaa\n    color: red", "color"),
        (
            "tokens:\n  - tenant: a\n    token: aaaaaaaaaaaaaaaaaa\n"
            "  - tenant: b\n    token: aaaaaaaaaaaaaaaaaa",
            "tokens[1] repeats",
        ),
        ("tokens: [unclosed", "not valid"),
    ],
)
def test_bad_tokens_files_are_refused_naming_the_problem(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="tokens|config file") as info:
        read_tokens_file(path)
    assert fragment in str(info.value)
    assert "aaaaaaaaaaaaaaaaaa" not in str(info.value)  # a token never shows in an error


def test_missing_tokens_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokens file .*missing.yaml does not exist"):
        Authenticator(tokens_file=tmp_path / "missing.yaml")


def _accepted(auth: Authenticator, token: str) -> bool:
    try:
        auth.authenticate(f"Bearer {token}")
    except Unauthenticated:
        return False
    return True


def _registers(address: str, token: str, ns: Namespace) -> bool:
    """Whether a client with ``token`` gets ``ns`` registered (False: unauthenticated)."""
    try:
        with CacheClient(address, auth_token=token) as c:
            c.register_namespace(ns)
    except errors.Unauthenticated:
        return False
    return True


def _rewrite(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)  # a new inode: the change is seen even within one mtime tick


def test_tokens_file_is_reread_when_it_changes(tokens_file: Path) -> None:
    auth = Authenticator(tokens_file=tokens_file)
    assert auth.authenticate(f"Bearer {ACME}").tenant == "acme"
    rotated = "acme-token-rotated-1"
    _rewrite(tokens_file, TOKENS.replace(ACME, rotated))
    wait_until(  # the file is looked at again at most once a RECHECK_S
        lambda: not _accepted(auth, ACME), 10 * RECHECK_S + 10, "the old token refused"
    )
    assert auth.authenticate(f"Bearer {rotated}").tenant == "acme"


def test_a_broken_tokens_file_keeps_the_previous_tokens(
    tokens_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = Authenticator(tokens_file=tokens_file)
    _rewrite(tokens_file, TOKENS + "\n  - tenant: c\n    token: broken\n")
    with caplog.at_level(logging.INFO):
        with pytest.raises(ConfigError, match="at least 16"):
            auth.reload()
        assert auth.authenticate(f"Bearer {ACME}").tenant == "acme"
        for _ in range(3):  # the lazy check logs the bad file and keeps serving
            time.sleep(RECHECK_S)  # the behaviour under test: a recheck interval passes
            assert auth.authenticate(f"Bearer {BOB}").tenant == "bob"
    assert "keeping the previous tokens" in caplog.text
    for token in (ACME, BOB, ADMIN, ACME_READER):
        assert token not in caplog.text


# -- namespace ids ----------------------------------------------------------------------------


def test_namespace_ids_of_different_tenants_never_collide() -> None:
    tenants = ["acme", "bob", "default", 'a"', "a\\", "a,b", "ACME", "acme ", "é", "a" * 256]
    ids = {make_namespace(tenant=t).namespace_id for t in tenants}
    assert len(ids) == len(tenants)
    tokens = list(range(64))
    hashes = {chunk_hashes(make_namespace(tenant=t), tokens)[0] for t in tenants}
    assert len(hashes) == len(tenants)  # so no chunk key is shared either


# -- REST -------------------------------------------------------------------------------------


@pytest.fixture
def rest(serve_http: Callable[..., Served], tokens_file: Path) -> Served:
    return serve_http(auth=Authenticator(tokens_file=tokens_file))


def _register(c: httpx.Client, ns: Namespace, token: str) -> str:
    r = c.post("/v1/namespaces", json=ns.to_dict(), headers=bearer(token))
    assert r.status_code == 200, r.text
    return str(r.json()["namespace_id"])


def test_rest_token_registers_only_its_tenants_namespaces(rest: Served) -> None:
    c = rest.client
    _register(c, make_namespace(tenant="acme"), ACME)
    r = c.post("/v1/namespaces", json=make_namespace(tenant="bob").to_dict(), headers=bearer(ACME))
    assert_error(r, 403, "permission_denied", "tenant 'acme'", "'bob'")
    keys = {"namespace": make_namespace(tenant="bob").to_dict(), "token_ids": list(range(16))}
    assert_error(c.post("/v1/keys", json=keys, headers=bearer(ACME)), 403, "permission_denied")
    assert rest.cache.stats().num_namespaces == 1
    _register(c, make_namespace(tenant="bob"), ADMIN)  # an admin token registers for any tenant


def test_rest_other_tenants_namespace_looks_unregistered(rest: Served) -> None:
    c = rest.client
    bob_ns = make_namespace(tenant="bob")
    bob_hex = _register(c, bob_ns, BOB)
    (h,) = chunk_hashes(bob_ns, list(range(16)))
    url = f"/v1/chunks/{bob_hex}/{h.hex()}"
    original = make_chunk(1)
    assert c.put(url, content=original, headers=bearer(BOB)).status_code == 201
    never = make_namespace(tenant="bob", model="never-registered").namespace_id.hex()
    requests: list[tuple[str, Callable[[str], str], dict[str, object]]] = [
        ("GET", lambda ns: f"/v1/chunks/{ns}/{h.hex()}", {}),
        ("HEAD", lambda ns: f"/v1/chunks/{ns}/{h.hex()}", {}),
        ("DELETE", lambda ns: f"/v1/chunks/{ns}/{h.hex()}", {}),
        ("PUT", lambda ns: f"/v1/chunks/{ns}/{h.hex()}", {"content": make_chunk(2)}),  # poison
        ("POST", lambda ns: "/v1/lookup", {"chunk_hashes": [h.hex()]}),
        ("POST", lambda ns: "/v1/keys", {"token_ids": list(range(16))}),
    ]
    for method, path, extra in requests:
        sent = []
        for ns_hex in (bob_hex, never):
            kw = dict(extra)
            if method == "POST":
                kw = {"json": {"namespace_id": ns_hex, **extra}}
            r = c.request(method, path(ns_hex), headers=bearer(ACME), **kw)  # type: ignore[arg-type]
            assert r.status_code == 404, (method, path(ns_hex), r.text)
            sent.append(r)
        if method != "HEAD":  # same body, but for the id: nothing tells the two apart
            theirs, unknown = (r.json() for r in sent)
            assert theirs["error"] == unknown["error"] == "unknown_namespace"
            assert theirs["message"].replace(bob_hex, never) == unknown["message"]
    # bob's chunk is untouched: not deleted, not overwritten
    r = c.get(url, headers=bearer(BOB))
    assert r.status_code == 200 and r.content == original
    assert c.get(url, headers=bearer(ADMIN)).content == original


def test_rest_same_prompt_in_two_tenants_is_two_chunks(rest: Served) -> None:
    c = rest.client
    tokens = list(range(16))
    urls = {}
    for tenant, token in (("acme", ACME), ("bob", BOB)):
        ns = make_namespace(tenant=tenant)
        ns_hex = _register(c, ns, token)
        r = c.post(
            "/v1/keys", json={"namespace_id": ns_hex, "token_ids": tokens}, headers=bearer(token)
        )
        urls[token] = f"/v1/chunks/{ns_hex}/{r.json()['chunk_hashes'][0]}"
    assert urls[ACME] != urls[BOB]
    assert c.put(urls[ACME], content=make_chunk(7), headers=bearer(ACME)).status_code == 201
    # acme's write is not bob's: bob misses and stores its own bytes
    assert c.head(urls[BOB], headers=bearer(BOB)).status_code == 404
    assert c.put(urls[BOB], content=make_chunk(8), headers=bearer(BOB)).status_code == 201
    assert c.get(urls[BOB], headers=bearer(BOB)).content == make_chunk(8)


def test_rest_admin_only_and_read_only_routes(rest: Served) -> None:
    c = rest.client
    for path in ("/v1/stats", "/metrics"):
        for token in (ACME, BOB, ACME_READER):
            assert_error(c.get(path, headers=bearer(token)), 403, "permission_denied", "admin")
        assert c.get(path, headers=bearer(ADMIN)).status_code == 200
    assert c.get("/openapi.json", headers=bearer(ACME)).status_code == 200
    ns = make_namespace(tenant="acme")
    ns_hex = _register(c, ns, ACME_READER)  # registering is not a write of chunk data
    url = f"/v1/chunks/{ns_hex}/{'ab' * 32}"
    r = c.put(url, content=make_chunk(3), headers=bearer(ACME_READER))
    assert_error(r, 403, "permission_denied", "read-only")
    assert c.put(url, content=make_chunk(3), headers=bearer(ACME)).status_code == 201
    assert c.get(url, headers=bearer(ACME_READER)).content == make_chunk(3)
    assert_error(c.delete(url, headers=bearer(ACME_READER)), 403, "permission_denied")
    assert c.head(url, headers=bearer(ACME)).status_code == 200
    assert_error(c.get(url, headers=bearer("acme-token-00000002")), 401, "unauthenticated")


def test_rest_openapi_declares_the_refusals(rest: Served) -> None:
    spec = rest.client.get("/openapi.json", headers=bearer(ADMIN)).json()
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    chunk = spec["paths"]["/v1/chunks/{namespace_id}/{chunk_hash}"]
    assert {"401", "403"} <= set(chunk["put"]["responses"])
    assert "401" in chunk["get"]["responses"]
    assert "403" in spec["paths"]["/v1/stats"]["get"]["responses"]
    assert "401" not in spec["paths"]["/healthz"]["get"]["responses"]


# -- gRPC -------------------------------------------------------------------------------------


@pytest.fixture
def grpc_server(tmp_path: Path, tokens_file: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, env={"LMCACHE_SVC_TOKENS_FILE": str(tokens_file)})
    yield proc
    proc.cleanup()


GRPC_NS = make_namespace(tenant="bob", chunk_size=256)


def test_grpc_other_tenants_namespace_looks_unregistered(grpc_server: ServerProc) -> None:
    hashes = chunk_hashes(GRPC_NS, list(range(512)))
    data = [make_chunk(i, GRPC_NS.chunk_bytes) for i in range(2)]
    with CacheClient(grpc_server.grpc, auth_token=BOB) as bob:
        bob_id = bob.register_namespace(GRPC_NS)
        assert bob.put(bob_id, list(zip(hashes, data))) == 2
        assert bob.touch(bob_id, hashes) == 2  # read in place: reported
    never = make_namespace(tenant="bob", chunk_size=256, model="never").namespace_id
    with CacheClient(grpc_server.grpc, auth_token=ACME) as acme:
        with pytest.raises(errors.PermissionDenied, match="tenant 'acme'"):
            acme.register_namespace(GRPC_NS)
        calls: list[Callable[[bytes], object]] = [
            lambda ns: acme.lookup(ns, hashes),
            lambda ns: acme.prepare_load(ns, hashes),
            lambda ns: acme.touch(ns, hashes),
            lambda ns: acme.get(ns, hashes),
            lambda ns: acme.delete(ns, hashes),
            lambda ns: acme.prepare_store(ns, hashes),
            lambda ns: acme.commit_store(ns, hashes),
            lambda ns: acme.put(ns, [(hashes[0], data[1])]),  # a poisoning attempt
        ]
        for call in calls:
            with pytest.raises(errors.UnknownNamespace) as theirs:
                call(bob_id)
            with pytest.raises(errors.UnknownNamespace) as unknown:
                call(never)
            assert str(theirs.value).replace(bob_id.hex(), never.hex()) == str(unknown.value)
        with pytest.raises(errors.PermissionDenied, match="admin"):
            acme.stats()
    with CacheClient(grpc_server.grpc, auth_token=BOB) as bob:
        assert bob.get(bob_id, hashes) == data  # untouched
    with CacheClient(grpc_server.grpc, auth_token=ADMIN) as admin:
        assert admin.stats()["num_namespaces"] == 1
        assert admin.lookup(bob_id, hashes).num_hit_chunks == 2


def test_grpc_read_only_token_cannot_write(grpc_server: ServerProc) -> None:
    ns = make_namespace(tenant="acme", chunk_size=256)
    hashes = chunk_hashes(ns, list(range(256)))
    with CacheClient(grpc_server.grpc, auth_token=ACME_READER) as reader:
        ns_id = reader.register_namespace(ns)
        with pytest.raises(errors.PermissionDenied, match="read-only"):
            reader.prepare_store(ns_id, hashes)
        with pytest.raises(errors.PermissionDenied, match="read-only"):
            reader.put(ns_id, [(hashes[0], make_chunk(0, ns.chunk_bytes))])
        with pytest.raises(errors.PermissionDenied, match="read-only"):
            reader.delete(ns_id, hashes)
        assert reader.lookup(ns_id, hashes).num_hit_chunks == 0
    with CacheClient(grpc_server.grpc, auth_token="not-a-token-at-all") as nobody:
        with pytest.raises(errors.Unauthenticated):
            nobody.lookup(ns_id, hashes)
        with pytest.raises(errors.Unauthenticated):  # server-streaming
            nobody.get(ns_id, hashes)
        with pytest.raises(errors.Unauthenticated):  # client-streaming
            nobody.put(ns_id, [(hashes[0], make_chunk(0, ns.chunk_bytes))])


def test_grpc_sighup_rereads_the_tokens_file(grpc_server: ServerProc, tokens_file: Path) -> None:
    rotated = "acme-token-rotated-1"
    _rewrite(tokens_file, TOKENS.replace(ACME, rotated))
    os.kill(grpc_server.proc.pid, signal.SIGHUP)
    ns = make_namespace(tenant="acme", chunk_size=256)
    wait_until(lambda: _registers(grpc_server.grpc, rotated, ns), 30, "the rotated token accepted")
    with CacheClient(grpc_server.grpc, auth_token=ACME) as old:
        with pytest.raises(errors.Unauthenticated):
            old.register_namespace(ns)
    log = grpc_server.log_path.read_text()
    assert "tokens file" in log
    for token in (ACME, rotated, BOB, ADMIN):
        assert token not in log


# -- start-up ---------------------------------------------------------------------------------


def test_tokens_file_counts_as_auth_for_an_exposed_host(tokens_file: Path) -> None:
    cfg = load_config(overrides={"host": "0.0.0.0", "tokens_file": str(tokens_file)})
    assert cfg.tokens_file == tokens_file
    with pytest.raises(ConfigError, match="tokens_file"):
        load_config(overrides={"host": "0.0.0.0"})


def test_server_refuses_to_start_with_a_bad_tokens_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.yaml"
    bad.write_text(f"tokens:\n  - tenant: acme\n    token: {ACME}\n  - token: {BOB}\n")
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_svc", "serve", "--no-http", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LMCACHE_SVC_TOKENS_FILE": str(bad)},
    )
    assert out.returncode == 2, out.stderr
    assert "tokens.1" in out.stderr and "exactly one of 'tenant' and 'admin" in out.stderr
    assert ACME not in out.stderr and BOB not in out.stderr
