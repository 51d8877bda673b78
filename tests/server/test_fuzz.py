"""Schema-driven fuzzing of the REST API from its own OpenAPI document (schemathesis).

Every operation gets valid and invalid requests generated from the document, with
authentication off, with an admin token, with a tenant's token and with none; chunk
operations also run against a registered namespace (random ids only reach the 404 path).
Each response must not be a 5xx, must have a status the document lists for the operation,
and must match the documented content type and (for JSON) schema. Bounded: a fixed number
of examples per operation and mode, no shrinking, no example database.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from lmcache_svc.cache import TieredCache
from lmcache_svc.cache.settings import CacheSettings
from lmcache_svc.keys import KVLayout, Namespace
from lmcache_svc.server.http.api import create_app
from lmcache_svc.server.tokens import Authenticator
from lmcache_svc.shm.arena import Arena
from lmcache_svc.tiers.cpu import CpuTier

pytestmark = pytest.mark.slow

ADMIN = "fuzz-admin-token-0001"
TENANT = "fuzz-tenant-token-001"
EXAMPLES = int(os.environ.get("LMCACHE_SVC_FUZZ_EXAMPLES", "20"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
NS = Namespace(
    model="fuzz",
    layout=KVLayout(
        "uint8", num_layers=1, num_kv_heads=1, head_size=8, block_size=16, page_layout="t"
    ),
    chunk_size=16,
    tenant="fuzzers",
)  # 256-byte chunks
NS_HEX = NS.namespace_id.hex()
MODES = ["off", "admin", "tenant", "no-token"]


@pytest.fixture(params=MODES)
def fuzzed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, dict[str, str]]]:
    mode: str = request.param
    arena = Arena.create(1 << 20, slab_bytes=16 * 1024, prefault="off")
    cache = TieredCache(CpuTier(arena), settings=CacheSettings(max_chunks_per_request=64))
    cache.register_namespace(NS)
    auth = None
    if mode != "off":
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(f"tokens:\n  - tenant: fuzzers\n    token: {TENANT}\n")
        auth = Authenticator(admin_token=ADMIN, tokens_file=tokens)
    app = create_app(cache, auth=auth, max_body_bytes=64 * 1024, max_json_bytes=16 * 1024)
    token = {"admin": ADMIN, "tenant": TENANT}.get(mode)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    yield app, headers
    cache.close()


def _fuzz(operation: Any, headers: dict[str, str], **overrides: Any) -> None:
    for generation_mode in GenerationMode:
        strategy = operation.as_strategy(generation_mode=generation_mode, **overrides)

        @given(case=strategy)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            _call(case, headers)
            if _aim_at_registered_namespace(case):
                _call(case, headers)

        try:
            run()
        except Unsatisfiable:
            # nothing to make invalid (no parameters, no body): only a negative run may be
            assert generation_mode is GenerationMode.NEGATIVE, operation.label


def _call(case: Any, headers: dict[str, str]) -> None:
    response = case.call(headers=headers)
    case.validate_response(response, checks=CHECKS, headers=headers)


def _aim_at_registered_namespace(case: Any) -> bool:
    """Point a JSON body's namespace id at the registered namespace, and give a chunk PUT to
    it a body of the right size, so the fuzzer reaches past the 404s; False if neither."""
    if isinstance(case.body, dict) and isinstance(case.body.get("namespace_id"), str):
        case.body["namespace_id"] = NS.namespace_id.hex()
        return True
    if case.method.upper() == "PUT" and case.path_parameters.get("namespace_id") == NS_HEX:
        size = NS.chunk_bytes
        case.body = (bytes(case.body) if isinstance(case.body, bytes) else b"") * size
        case.body = (case.body + bytes(size))[:size]
        return True
    return False


def test_fuzz_rest_api(fuzzed: tuple[Any, dict[str, str]]) -> None:
    app, headers = fuzzed
    schema = schemathesis.openapi.from_dict(json.loads(json.dumps(app.openapi())))
    schema.app = app
    operations: list[Any] = []
    for result in schema.get_all_operations():
        assert not isinstance(result, Err), result.err()  # the document itself is valid
        operations.append(result.ok())
    assert len(operations) >= 11
    for operation in operations:
        _fuzz(operation, headers)
        if "{namespace_id}" in operation.path:
            _fuzz(operation, headers, path_parameters={"namespace_id": NS_HEX})
