"""End to end against a real ``lmcache-svc serve``: memories added by one process are seen,
merged and generated with by another; the MemOS example's flow runs with only the imports
changed (the service is named by LMCACHE_MEMORY_SERVICE, as a deployment would)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_svc.client import CacheClient
from lmcache_svc.kv_memory import KVCacheMemory
from lmcache_svc.kv_memory.tiny_model import sample_text
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.kv_memory.conftest import memos_config

WRITER = textwrap.dedent(
    """
    import json, sys
    from lmcache_svc.kv_memory import KVCacheMemory, KVCacheMemoryConfig
    from lmcache_svc.kv_memory.tiny_model import sample_text
    model_dir, address, out = sys.argv[1:4]
    mem = KVCacheMemory(KVCacheMemoryConfig(
        extractor_llm={"backend": "huggingface", "config": {"model_name_or_path": model_dir}},
        service_address=address,
    ))
    a, b = mem.extract(sample_text(80, 21)), mem.extract(sample_text(50, 22))
    a.metadata["doc"] = "a"
    mem.add([a, b])
    query = sample_text(8, 23)
    tokens = mem.generate_ids(query, [a.id], max_new_tokens=8).token_ids
    result = {"ids": [a.id, b.id], "tokens": tokens}
    json.dump(result, open(out, "w"))
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, "--memory-bytes", "64MiB")
    yield proc
    proc.cleanup()


def test_a_memory_added_by_one_process_is_used_by_another(
    server: ServerProc, plain_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "writer.json"
    subprocess.run(
        [sys.executable, "-c", WRITER, str(plain_model_dir), server.socket, str(out)],
        check=True,
        timeout=240,
    )
    written = json.loads(out.read_text())
    a_id, b_id = written["ids"]

    reader = KVCacheMemory(memos_config(plain_model_dir, service_address=server.grpc))
    assert sorted(i.id for i in reader.get_all()) == sorted([a_id, b_id])
    a = reader.get(a_id)
    assert a is not None and a.metadata["doc"] == "a" and a.model == reader.llm.identity
    query = sample_text(8, 23)
    injected = reader.generate_ids(query, [a_id], max_new_tokens=8)
    assert injected.token_ids == written["tokens"]
    assert (
        injected.token_ids
        == reader.generate_ids(query, [a_id], inject=False, max_new_tokens=8).token_ids
    )
    merged = reader.get_cache([a_id, b_id])
    assert merged is not None and merged.get_seq_length() == 81 + 51

    # The REST side sees the same memories; a delete by this process is seen by a new client.
    with CacheClient(server.socket) as client:
        assert {m.memory_id for m in client.list_memories()} == {a_id, b_id}
    reader.delete([a_id])
    with CacheClient(server.socket) as client:
        assert [m.memory_id for m in client.list_memories()] == [b_id]


MEMOS_EXAMPLE_FLOW = textwrap.dedent(
    """
    import json, sys
    # The only lines changed from MemOS's example: these imports.
    from lmcache_svc.kv_memory import MemoryConfigFactory, MemoryFactory, KVCacheItem
    from transformers import DynamicCache

    model_dir, dump_dir, out = sys.argv[1:4]

    def summary(obj):
        if isinstance(obj, list):
            return [summary(x) for x in obj]
        if isinstance(obj, KVCacheItem):
            return {"id": obj.id, "metadata": obj.metadata, "records": obj.records,
                    "memory": summary(obj.memory)}
        if isinstance(obj, DynamicCache):
            return {"num_layers": len(obj.layers), "seq": obj.get_seq_length()}
        return str(obj)

    config = MemoryConfigFactory(
        backend="kv_cache",
        config={"extractor_llm": {"backend": "huggingface", "config": {
            "model_name_or_path": model_dir, "max_tokens": 32,
            "add_generation_prompt": True, "remove_think_prefix": True}}},
    )
    kv_mem = MemoryFactory.from_config(config)
    prompt = [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w4 w5"}]
    steps = {}
    cache_item = kv_mem.extract(prompt)
    steps["extract"] = summary(cache_item)
    kv_mem.add([cache_item])
    steps["add"] = summary(kv_mem.get_all())
    steps["get"] = summary(kv_mem.get(cache_item.id))
    item2 = kv_mem.extract([{"role": "user", "content": "w6 w7"}])
    kv_mem.add([item2])
    steps["merged"] = summary(kv_mem.get_cache([cache_item.id, item2.id]))
    kv_mem.delete([cache_item.id])
    steps["after_delete"] = summary(kv_mem.get_all())
    kv_mem.dump(dump_dir)
    kv_mem.delete_all()
    steps["after_delete_all"] = summary(kv_mem.get_all())
    kv_mem.load(dump_dir)
    steps["loaded"] = summary(kv_mem.get_all())
    steps["ids"] = [cache_item.id, item2.id]
    json.dump(steps, open(out, "w"))
    """
)


def test_the_memos_usage_example_runs_against_the_service(
    server: ServerProc, chat_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "example.json"
    subprocess.run(
        [
            sys.executable,
            "-c",
            MEMOS_EXAMPLE_FLOW,
            str(chat_model_dir),
            str(tmp_path / "dump"),
            str(out),
        ],
        check=True,
        timeout=240,
        env={**__import__("os").environ, "LMCACHE_MEMORY_SERVICE": server.socket},
    )
    steps = json.loads(out.read_text())
    first_id, second_id = steps["ids"]
    # <s> <|user|> w1 w2 w3 <|end|> <|assistant|> w4 w5 <|end|>
    assert steps["extract"]["memory"] == {"num_layers": 2, "seq": 10}
    assert [i["id"] for i in steps["add"]] == [first_id]
    assert steps["get"]["id"] == first_id
    assert steps["merged"] == {"num_layers": 2, "seq": 10 + 5}
    assert [i["id"] for i in steps["after_delete"]] == [second_id]
    assert steps["after_delete_all"] == []
    assert [i["id"] for i in steps["loaded"]] == [second_id]
    # It all happened in the service.
    with CacheClient(server.socket) as client:
        assert [m.memory_id for m in client.list_memories()] == [second_id]
