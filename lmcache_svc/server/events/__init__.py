"""KV events: what the tiers hold, published in vLLM's event format (docs/events.md).

``format`` (the wire structs), ``meta`` (chunks' token ids and parents), ``node_stream``
(the cache's listener that builds the events), ``publisher`` (ZMQ PUB, replay, sequence),
``redis_channel`` (what servers sharing a Redis announce to each other), ``settings``.
"""
