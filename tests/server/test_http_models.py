"""The REST namespace models are generated from ``keys.Namespace``/``KVLayout``; their
document is pinned here (what clients of the REST API rely on)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from pydantic import ValidationError

from lmcache_svc.errors import InvalidArgument
from lmcache_svc.keys import MAX_FIELD_VALUE, KVLayout, Namespace
from lmcache_svc.server.http.models import KVLayoutModel, NamespaceModel

BOUNDED = {"maximum": MAX_FIELD_VALUE, "type": "integer"}


def test_the_models_have_the_dataclasses_fields() -> None:
    for cls, model in ((KVLayout, KVLayoutModel), (Namespace, NamespaceModel)):
        assert list(model.model_fields) == [f.name for f in fields(cls) if f.init]


def test_the_namespace_document_is_unchanged() -> None:
    schema = NamespaceModel.model_json_schema(ref_template="#/components/schemas/{model}")
    layout = schema.pop("$defs")["KVLayoutModel"]
    assert schema["required"] == ["model", "layout"]
    assert schema["additionalProperties"] is False
    assert schema["description"].startswith("``Namespace.to_dict()`` form.")
    assert schema["properties"] == {
        "model": {"title": "Model", "type": "string"},
        "layout": {"$ref": "#/components/schemas/KVLayoutModel"},
        "chunk_size": {"default": 256, "minimum": 1, "title": "Chunk Size", **BOUNDED},
        "tp_rank": {"default": 0, "minimum": 0, "title": "Tp Rank", **BOUNDED},
        "tp_size": {"default": 1, "minimum": 1, "title": "Tp Size", **BOUNDED},
        "tenant": {"default": "default", "title": "Tenant", "type": "string"},
        "key_version": {"default": 1, "title": "Key Version", "type": "integer"},
    }
    assert layout["required"] == [
        "dtype",
        "num_layers",
        "num_kv_heads",
        "head_size",
        "block_size",
        "page_layout",
    ]
    assert "description" not in layout
    assert layout["properties"]["dtype"] == {
        "examples": ["bfloat16"],
        "title": "Dtype",
        "type": "string",
    }
    assert layout["properties"]["num_kv_heads"] == {
        "description": "KV heads held by this tensor-parallel rank",
        "minimum": 1,
        "title": "Num Kv Heads",
        **BOUNDED,
    }
    assert layout["properties"]["kv_planes"] == {
        "default": 2,
        "description": "2 for separate K and V, 1 for MLA",
        "title": "Kv Planes",
        "type": "integer",
    }


LAYOUT: dict[str, Any] = {
    "dtype": "uint8",
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_size": 128,
    "block_size": 16,
    "page_layout": "test",
}


def test_a_body_becomes_the_namespace_it_names() -> None:
    body = NamespaceModel.model_validate({"model": "m", "layout": LAYOUT, "tp_size": 2})
    expected = Namespace(model="m", layout=KVLayout(**LAYOUT), tp_size=2)
    assert body.to_namespace() == expected


def test_types_are_strict_and_ranges_are_the_namespaces() -> None:
    with pytest.raises(ValidationError):  # a 422: a string is not an int
        NamespaceModel.model_validate({"model": "m", "layout": LAYOUT, "chunk_size": "256"})
    with pytest.raises(ValidationError):  # a 422: unknown field
        NamespaceModel.model_validate({"model": "m", "layout": LAYOUT, "chunks": 1})
    body = NamespaceModel.model_validate({"model": "m", "layout": LAYOUT, "chunk_size": 0})
    with pytest.raises(InvalidArgument, match="chunk_size must be a positive integer"):
        body.to_namespace()  # a 400 naming the field
