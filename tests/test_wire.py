"""The wire's shared tables: error kinds and store statuses, derived from their sources."""

from __future__ import annotations

import typing

import pytest

from lmcache_svc import errors
from lmcache_svc.results import StoreStatus
from lmcache_svc.v1 import cache_pb2 as pb
from lmcache_svc.wire import STORE_STATUS_CODES, STORE_STATUS_NAMES, error_from_kind


def every_error_class() -> list[type[errors.LMCacheSvcError]]:
    found = [errors.LMCacheSvcError]
    for cls in found:
        found.extend(cls.__subclasses__())
    return found


def test_the_tree_has_the_classes_the_wire_must_know() -> None:
    names = {cls.__name__ for cls in every_error_class()}
    assert {"UnknownNamespace", "ReservationLimit", "Corrupted", "ServerUnavailable"} <= names
    kinds = [cls.kind for cls in every_error_class()]
    assert len(kinds) == len(set(kinds)), "two exception classes share a kind"


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_kind_names_its_own_class(cls: type[errors.LMCacheSvcError]) -> None:
    error = error_from_kind(cls.kind, "why")
    assert type(error) is cls and str(error) == "why"


def test_an_unknown_kind_is_the_base_class() -> None:
    error = error_from_kind("from_a_newer_server", "why")
    assert type(error) is errors.LMCacheSvcError


def test_store_statuses_cover_the_literal_and_the_enum_both_ways() -> None:
    assert set(STORE_STATUS_CODES) == set(typing.get_args(StoreStatus))
    named = {pb.StoreStatus.Name(code) for code in STORE_STATUS_CODES.values()}
    assert named == {n for n in pb.StoreStatus.keys() if n != "STORE_STATUS_UNSPECIFIED"}
    assert {STORE_STATUS_NAMES[code]: code for code in STORE_STATUS_NAMES} == STORE_STATUS_CODES
