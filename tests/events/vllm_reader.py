"""Read a KV event stream with vLLM's own classes (run with .venv-vllm's interpreter).

    python vllm_reader.py ENDPOINT [TOPIC]

Subscribes to ENDPOINT, decodes every batch with ``msgspec`` and
``vllm.distributed.kv_events.KVEventBatch`` (vLLM's decoder: what proves the stream is in
vLLM's format), and prints one JSON line per event: its type, the batch's sequence number
and the event's fields. A frame vLLM's classes cannot decode is printed as
``{"type": "undecodable", "error": ...}``. Runs until killed.
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch


def main() -> None:
    endpoint = sys.argv[1]
    topic = sys.argv[2].encode() if len(sys.argv) > 2 else b""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sub = zmq.Context().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    print(json.dumps({"type": "ready"}), flush=True)
    while True:
        got_topic, seq, payload = sub.recv_multipart()
        number = int.from_bytes(seq, "big", signed=True)
        try:
            batch = decoder.decode(payload)
        except msgspec.MsgspecError as e:
            print(json.dumps({"type": "undecodable", "error": str(e)}), flush=True)
            continue
        for event in batch.events:
            fields = msgspec.to_builtins(event)
            fields.update(type=type(event).__name__, seq=number, topic=got_topic.decode())
            fields["dp_rank"] = batch.data_parallel_rank
            print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    main()
