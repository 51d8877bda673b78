"""An engine's KV event stream without an engine (run with .venv-vllm's interpreter).

    python engine_stand_in.py SERVER_SOCKET PUB_ENDPOINT

Plays the part of vLLM's scheduler in what reaches the engine's ZMQ stream: vLLM's own
``ZmqEventPublisher``, the plugin's ``EngineEvents`` following the sidecar (a real server,
through a real ``ServerLink``) and vLLM's GPU events, built as vLLM's block pool builds them
(``hash_block_tokens`` chained from this process's ``NONE_HASH``, the default ``sha256``;
``kv_cache_spec_kind`` as ``KVCacheManager.take_events`` annotates them). Like vLLM, it
publishes only when it steps: the GPU events queued since the last step first, then what
the connector's ``take_events`` returns, in one batch.

Commands, one JSON object per line on stdin; each is answered by one JSON line:

- ``{"gpu": [tokens]}``: queue vLLM's ``BlockStored`` for the prompt's full blocks;
- ``{"gpu_removed": [tokens]}``: queue vLLM's ``BlockRemoved`` for them, one per block;
- ``{"step": true}``: publish what is queued; answers the events published
  (``[type, medium, number of blocks]`` each).

Prints ``{"ready": true}`` once the plugin has taken its first snapshot of the sidecar.
"""

from __future__ import annotations

import json
import sys
import time

from lmcache_svc.keys import KVLayout, Namespace

BLOCK = 16
CHUNK = 32  # two of the engine's blocks per chunk


def namespace() -> Namespace:
    """The namespace the stand-in's plugin registers (and a test stores chunks in)."""
    layout = KVLayout("uint8", 1, 1, 128, BLOCK, "test")
    return Namespace(model="engine-stand-in", layout=layout, chunk_size=CHUNK)


def main() -> None:
    from lmcache_svc_vllm.config import ConnectorConfig
    from lmcache_svc_vllm.events import EngineEvents
    from lmcache_svc_vllm.link import ServerLink
    from vllm.distributed.kv_events import (
        BlockRemoved,
        BlockStored,
        KVCacheEvent,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    server_socket, endpoint = sys.argv[1], sys.argv[2]
    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default --prefix-caching-hash-algo
    kv_cache_utils.init_none_hash(hash_fn)  # as the engine does at start-up

    def gpu_hashes(tokens: list[int]) -> list[int]:
        out: list[int] = []
        parent = None
        for j in range(len(tokens) // BLOCK):
            parent = hash_block_tokens(hash_fn, parent, tokens[j * BLOCK : (j + 1) * BLOCK])
            out.append(maybe_convert_block_hash(parent))
        return out

    config = ConnectorConfig(url=server_socket, chunk_size=CHUNK, retry_interval_s=0.2)
    link = ServerLink(config, namespace(), "engine-stand-in")
    plugin = EngineEvents(link, BLOCK, hash_fn)
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="engine-stand-in")
    deadline = time.monotonic() + 30
    while plugin.num_resyncs == 0:
        if time.monotonic() > deadline:
            raise SystemExit("the plugin never took a snapshot of the sidecar")
        time.sleep(0.05)
    print(json.dumps({"ready": True}), flush=True)

    pending: list[KVCacheEvent] = []
    for line in sys.stdin:
        command = json.loads(line)
        answer: dict[str, object] = {}
        if "gpu" in command:
            tokens = command["gpu"]
            hashes = gpu_hashes(tokens)
            pending.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=tokens[: len(hashes) * BLOCK],
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * len(hashes),
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        elif "gpu_removed" in command:
            pending += [
                BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
                for h in gpu_hashes(command["gpu_removed"])
            ]
        elif command.get("step"):
            events, pending = pending + list(plugin.take()), []
            if events:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
            answer["published"] = [
                [type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", ()))]
                for e in events
            ]
        print(json.dumps(answer), flush=True)
    plugin.close()
    publisher.shutdown()


if __name__ == "__main__":
    main()
