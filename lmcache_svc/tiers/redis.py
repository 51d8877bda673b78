"""The Redis tier: chunk bytes in a Redis or Redis Cluster that several servers may share.

Layout: exactly one Redis key per chunk, ``key_prefix + hex(ChunkKey)``, whose value is a
fixed 72-byte header followed by the payload, so metadata and bytes are written, expired and
evicted together and can never disagree. The header (little-endian, ``HEADER``) holds the
magic ``b"LMCR"``, format version (u8), flags (u8), reserved (u16), payload length (u64),
``xxh3_64`` of the payload (u64) and the 48-byte ``ChunkKey``. A read checks all of them; any
mismatch deletes the key and raises ``Corrupted``. Version 2 (written when the store carried
the chunk's description, ``Tier.describe``: KV events on) puts the description between the
header and the payload (``described.py``: 37 + 4 * tokens bytes), so another server, or this
one after a restart, can announce the chunk (``describe_many`` reads only the header and the
description, with two pipelined GETRANGEs); version 1 values (events off, or written before)
are read as before.

Capacity: ``capacity_bytes`` bounds this server's own accounting, the payload bytes of the
chunks it wrote plus those ``scan()`` found at start-up (the 72-byte headers and Redis's own
overhead are not counted). In a shared deployment other servers' keys are not counted either:
Redis's ``maxmemory`` with an eviction policy is the backstop, and a SET that Redis refuses
with ``-OOM`` answers "does not fit". A key that Redis expired or evicted leaves the
accounting when a read, ``size_of`` or ``contains_many`` finds it missing.

Speed: a batch is split over ``num_connections`` worker threads, each pipelining its share on
its own connection. This bulk path uses redis-py to connect (auth, TLS, database, handshake,
cluster topology) but speaks RESP on the connection's socket itself: a SET sends header and
payload as separate buffers (no joined copy) and a GET reply is received straight into the
caller's buffer, where redis-py's pure-Python parser copies each value several times into
fresh memory. Cluster redirections and dropped connections fall back to redis-py's ordinary
commands, which reconnect and follow the cluster's topology.

Failure: socket connect and read timeouts are ``timeout_s``. A dropped connection (Redis
restarted) is retried once on a fresh connection, whose handshake reads the server's
``run_id``: a new one bumps ``generation`` (the cache then resyncs its index, even when no
call failed). A timeout is not retried, so a hung Redis costs a caller one ``timeout_s`` (and
the cache's circuit breaker, ``breaker.py``, stops sending it calls until a probe succeeds).
Every redis-py or socket error becomes ``TierError`` naming the URL (password hidden) and
operation; the batch forms report it per chunk (``Failed``), so the chunks that were written
stay counted and known to the caller while the refused ones are neither.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from itertools import islice
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError
from redis.retry import Retry

from lmcache_svc.errors import Corrupted, InvalidArgument, TierError
from lmcache_svc.keys import CHUNK_KEY_BYTES, ChunkKey
from lmcache_svc.tiers.base import Buffer, ChunkDescription, Failed, ItemResult, Tier
from lmcache_svc.tiers.described import TOKEN_BYTES, description_tokens, unpack_description
from lmcache_svc.tiers.ledger import SizeLedger
from lmcache_svc.tiers.redis_wire import (
    BACKEND_ERRORS,
    DESCRIBED_VERSION,
    HEAD_PROBE,
    HEADER,
    MAGIC,
    MAX_TOKENS,
    MIN_SHARD_BYTES,
    OK,
    Job,
    Outcome,
    byte_view,
    check_args,
    check_url,
    check_value,
    error_outcome,
    fetch_values,
    glob_escape,
    pack_header,
    payload_size,
    redact_url,
    send_sets,
    stream_shard,
)

__all__ = ["HEADER", "RedisTier"]

log = logging.getLogger(__name__)

_SCAN_COUNT = 1000


class RedisTier(Tier):
    """Chunks as single Redis keys (header + payload); see the module docstring."""

    medium = "remote"
    shared = True

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        cluster: bool = False,
        ttl_s: float | None = None,
        num_connections: int = 4,
        key_prefix: str = "lmcache-svc:v1:",
        timeout_s: float = 5.0,
        name: str = "redis",
    ) -> None:
        check_url(url, cluster)
        check_args(capacity_bytes, ttl_s, num_connections, key_prefix, timeout_s, name)
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.url = redact_url(url)
        self._raw_url = url
        self._cluster = cluster
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._prefix = key_prefix.encode()
        self._num_connections = num_connections
        self._timeout_s = float(timeout_s)
        self._ledger = SizeLedger(capacity_bytes)
        self._connect_lock = threading.Lock()
        self._client_obj: Any = None
        self._run_id: str | None = None
        self._run_id_lock = threading.Lock()
        self.generation = 0
        self._executor = ThreadPoolExecutor(num_connections, thread_name_prefix=f"{name}-io")
        self._closed = False

    # -- accounting ------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._ledger.used_bytes

    @property
    def num_chunks(self) -> int:
        return self._ledger.num_chunks

    # -- the Tier contract -----------------------------------------------------------------

    def put(self, key: ChunkKey, data: Buffer) -> bool:
        return _single(self.put_many([(key, data)])[0])

    def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        return _single(self.read_many_into([(key, out)])[0])

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[ItemResult]:
        """Per item: ``True`` written and counted, ``False`` over capacity or refused by
        Redis for memory (``-OOM``: told to ``on_refused``), ``Failed`` any other refusal;
        only ``True`` items stay counted. A batch cut off as a whole (connection lost,
        timeout) is ``Failed`` for every item and none is counted, though Redis may hold
        some of them: its ``maxmemory`` and TTL, and the next start-up scan, account for
        those."""
        jobs = [self._job(key, byte_view(data, "data")) for key, data in items]
        if self.describe is not None:
            for job in jobs:
                job.desc = self.describe(job.key)
        results: list[ItemResult] = [False] * len(jobs)
        reserved: dict[int, int | None] = {}
        for i, job in enumerate(jobs):
            fits, old = self._ledger.reserve(job.key, len(job.data))
            if fits:
                reserved[i] = old
        todo = list(reserved)
        try:
            outcomes = self._execute(
                "put", [jobs[i] for i in todo], self._send_sets, self._put_slow
            )
        except BaseException as e:
            for i in todo:  # unknown what was written: count none of it
                self._ledger.unreserve(jobs[i].key, len(jobs[i].data), reserved[i])
            if not isinstance(e, TierError):
                raise
            outcomes = [("error", str(e))] * len(todo)
            batch_error: TierError | None = e
        else:
            batch_error = None
        refused = sum(status == "oom" for status, _ in outcomes)
        if refused and self.on_refused is not None:
            self.on_refused(refused)
        for i, (status, detail) in zip(todo, outcomes):
            if status == "ok":
                results[i] = True
                continue
            if batch_error is None:
                self._ledger.unreserve(jobs[i].key, len(jobs[i].data), reserved[i])
            if status != "oom":
                results[i] = Failed(batch_error or TierError(
                    f"Redis put of chunk {jobs[i].key.hex()} on {self.url} failed: {detail}"
                ))  # fmt: skip
        return results

    def read_many_into(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[ItemResult]:
        """Per item: ``True`` read, ``False`` missing (it leaves the accounting), ``Failed``
        with ``Corrupted`` (the value failed its checks and was deleted) or ``TierError``
        (Redis refused or did not answer; the chunk stays counted)."""
        jobs = [self._job(key, byte_view(out, "out", writable=True)) for key, out in items]
        try:
            outcomes = self._execute("read", jobs, fetch_values, self._read_slow)
        except TierError as e:
            return [Failed(e)] * len(jobs)
        results: list[ItemResult] = []
        bad_size: list[str] = []
        for job, (status, detail) in zip(jobs, outcomes):
            results.append(status == "ok")
            if status == "miss":
                self._ledger.drop(job.key)
            elif status == "corrupt":
                self._discard(job.key)
                results[-1] = Failed(Corrupted(
                    f"Redis chunk {job.key.hex()} on {self.url} failed its header or checksum "
                    f"check ({detail}) and was deleted"
                ))  # fmt: skip
            elif status == "bad_size":
                bad_size.append(f"{job.key.hex()}: {detail}")
            elif status != "ok":
                results[-1] = Failed(TierError(
                    f"Redis read of chunk {job.key.hex()} on {self.url} failed: {detail}"
                ))  # fmt: skip
        if bad_size:
            raise InvalidArgument(f"read buffer size mismatch: {bad_size[0]}")
        return results

    def size_of(self, key: ChunkKey) -> int | None:
        rkey = self._rkey(key)
        with self._errors("size_of"):
            pipe = self._client.pipeline(transaction=False)
            pipe.getrange(rkey, 0, HEAD_PROBE - 1)
            pipe.strlen(rkey)
            header, value_size = pipe.execute()
        if not value_size:
            self._ledger.drop(key)
            return None
        length = payload_size(key, header, value_size)
        if isinstance(length, str):
            self._discard(key)
            raise Corrupted(f"Redis chunk {key.hex()} on {self.url}: {length}; deleted")
        return length

    def delete(self, key: ChunkKey) -> int:
        rkey = self._rkey(key)
        with self._errors("delete"):
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(rkey)
            pipe.delete(rkey)
            value_size, num_deleted = pipe.execute()
        self._ledger.drop(key)
        return max(0, value_size - HEADER.size) if num_deleted else 0

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        rkeys = [self._rkey(key) for key in keys]
        if not rkeys:
            return []
        with self._errors("contains_many"):
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            found = [bool(n) for n in pipe.execute()]
        for key, hit in zip(keys, found):
            if not hit:
                self._ledger.drop(key)
        return found

    def scan(self) -> Iterator[tuple[ChunkKey, int]]:
        """Chunks under ``key_prefix`` on every master, in Redis's SCAN order (Redis keeps no
        cheap global LRU order); each is added to this tier's accounting as it is yielded."""
        return self._scan_into(self._ledger)

    def rescan(self) -> Iterator[tuple[ChunkKey, int]]:
        """``scan`` into fresh accounting that then replaces the old one, as at start-up: a
        Redis that restarted (or lost keys) is counted for what it holds now."""
        fresh = SizeLedger(self.capacity_bytes)
        found = list(self._scan_into(fresh))
        self._ledger = fresh
        return iter(found)

    def _scan_into(self, ledger: SizeLedger) -> Iterator[tuple[ChunkKey, int]]:
        pattern = glob_escape(self._prefix) + b"*"
        with self._errors("scan"):
            for client in self._node_clients():
                keys = client.scan_iter(match=pattern, count=_SCAN_COUNT)
                while batch := list(islice(keys, _SCAN_COUNT)):
                    yield from self._scan_sizes(client, batch, ledger)
                    self._refuse_if_closed("scan")  # not on a connection made after close

    def describe_many(self, keys: Sequence[ChunkKey]) -> list[ChunkDescription | None]:
        """Each chunk's stored description: a pipelined GETRANGE of its value's header and
        the description's fixed part, then one of the token ids for the version 2 values (the
        payloads are not read); a damaged one is logged and answers ``None``."""
        out: list[ChunkDescription | None] = []
        for start in range(0, len(keys), _SCAN_COUNT):
            out += self._describe_batch(keys[start : start + _SCAN_COUNT])
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._connect_lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            client.close()
            if not self._cluster:
                client.connection_pool.disconnect()

    # -- helpers ---------------------------------------------------------------------------

    def _rkey(self, key: ChunkKey) -> bytes:
        if not isinstance(key, bytes) or len(key) != CHUNK_KEY_BYTES:
            raise InvalidArgument(f"chunk key must be {CHUNK_KEY_BYTES} bytes, got {key!r:.80}")
        return self._prefix + key.hex().encode()

    def _job(self, key: ChunkKey, data: memoryview) -> Job:
        return Job(key, self._rkey(key), data)

    def _key_of(self, rkey: bytes) -> ChunkKey | None:
        try:
            raw = bytes.fromhex(rkey[len(self._prefix) :].decode("ascii"))
        except ValueError:
            return None
        return ChunkKey(raw) if len(raw) == CHUNK_KEY_BYTES else None

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        self._refuse_if_closed(op)
        try:
            yield
        except TierError:
            raise
        except Exception as e:
            if self._closed:  # close() shut the sockets under this call (on another thread)
                raise TierError(
                    f"Redis tier {self.name!r} ({self.url}) was closed during {op}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if isinstance(e, BACKEND_ERRORS):
                raise TierError(f"Redis {op} on {self.url} failed: {type(e).__name__}: {e}") from e
            raise

    def _refuse_if_closed(self, op: str) -> None:
        if self._closed:
            raise TierError(f"Redis tier {self.name!r} ({self.url}) is closed; {op} refused")

    @property
    def _client(self) -> Any:
        with self._connect_lock:
            if self._client_obj is None:
                self._client_obj = self._connect()
            return self._client_obj

    def _connect(self) -> Any:
        options: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            # A dropped connection is worth one retry (a restarted Redis answers on a new
            # one); a timeout is not: a hung Redis would cost every caller twice.
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            "health_check_interval": 0,
        }
        if self._cluster:
            return RedisCluster.from_url(self._raw_url, **options)
        pool = redis.BlockingConnectionPool.from_url(
            self._raw_url,
            max_connections=2 * self._num_connections,
            timeout=self._timeout_s,
            redis_connect_func=self._on_connect,
            **options,
        )
        return redis.Redis(connection_pool=pool)

    def _on_connect(self, conn: Any) -> None:
        """redis-py's handshake, then the server's ``run_id``: a new one means Redis restarted
        (its contents may be gone), which bumps ``generation``."""
        conn.on_connect()
        conn.send_command("INFO", "server")
        info = conn.read_response()
        text = info.decode("ascii", "replace") if isinstance(info, bytes) else str(info)
        run_id = next(
            (line[7:].strip() for line in text.splitlines() if line.startswith("run_id:")), ""
        )
        with self._run_id_lock:
            if run_id and run_id != self._run_id:
                if self._run_id is not None:
                    self.generation += 1
                self._run_id = run_id

    def _node_clients(self) -> list[Any]:
        client = self._client
        if not self._cluster:
            return [client]
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def _pool_of(self, rkey: bytes) -> Any:
        client = self._client
        if not self._cluster:
            return client.connection_pool
        return client.get_redis_connection(client.get_node_from_key(rkey)).connection_pool

    def _scan_sizes(
        self, client: Any, rkeys: list[bytes], ledger: SizeLedger
    ) -> Iterator[tuple[ChunkKey, int]]:
        """Each value's payload size, from its size and its first ``HEAD_PROBE`` bytes (a
        version 2 value's payload starts after its description)."""
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.strlen(rkey)
            pipe.getrange(rkey, 0, HEAD_PROBE - 1)
        replies = pipe.execute()
        for rkey, value_size, head in zip(rkeys, replies[::2], replies[1::2]):
            key = self._key_of(rkey)
            if key is None or value_size < HEADER.size:
                continue
            size = payload_size(key, head, value_size)
            if isinstance(size, str):  # a damaged value: counted whole, a read deletes it
                size = value_size - HEADER.size
            ledger.record(key, size)
            yield key, size

    def _describe_batch(self, keys: Sequence[ChunkKey]) -> list[ChunkDescription | None]:
        rkeys = [self._rkey(key) for key in keys]
        with self._errors("describe"):
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, HEAD_PROBE - 1)
            heads: list[bytes] = pipe.execute()
            counts = [self._num_tokens(key, head) for key, head in zip(keys, heads)]
            todo = [i for i, n in enumerate(counts) if n]
            pipe = self._client.pipeline(transaction=False)
            for i in todo:
                pipe.getrange(rkeys[i], HEAD_PROBE, HEAD_PROBE + TOKEN_BYTES * counts[i] - 1)
            tokens = dict(zip(todo, pipe.execute()))
        out: list[ChunkDescription | None] = [None] * len(keys)
        for i, raw in tokens.items():
            try:
                out[i] = unpack_description(heads[i][HEADER.size :] + raw, keys[i], MAX_TOKENS)
            except ValueError as e:
                log.warning("Redis chunk %s: description refused: %s", keys[i].hex(), e)
        return out

    def _num_tokens(self, key: ChunkKey, head: bytes) -> int:
        """Tokens of the description a value's first bytes announce (0: none, or a damaged
        header, which a read of the value deletes; a count over ``MAX_TOKENS`` is logged)."""
        if len(head) < HEAD_PROBE or head[4] != DESCRIBED_VERSION:
            return 0
        magic, _, _, _, _, _, stored_key = HEADER.unpack_from(head)
        if magic != MAGIC or stored_key != key:
            return 0
        try:
            return description_tokens(head[HEADER.size :], MAX_TOKENS)
        except ValueError as e:
            log.warning("Redis chunk %s: description refused: %s", key.hex(), e)
            return 0

    def _discard(self, key: ChunkKey) -> None:
        """Delete a chunk that failed its checks (best effort: the read reports it anyway)."""
        self._ledger.drop(key)
        try:
            self._client.delete(self._rkey(key))
        except BACKEND_ERRORS:
            pass  # the caller raises Corrupted; the next read finds it again

    # -- batches ---------------------------------------------------------------------------

    def _execute(
        self,
        op: str,
        jobs: list[Job],
        stream: Callable[[list[Job], Any], list[Outcome]],
        slow: Callable[[Job], Outcome],
    ) -> list[Outcome]:
        """Run ``jobs`` over the worker connections; redirected ones go through redis-py.

        One outcome per job: a shard whose connection fails or times out marks its own jobs
        ``error`` (the other shards keep theirs), and so does a redis-py fallback that loses
        its connection, for the jobs it had left (they would wait the same way).
        """
        outcomes: list[Outcome] = [OK] * len(jobs)
        if not jobs:
            return outcomes
        with self._errors(op):
            shards = self._shards(jobs)

        def run(shard: tuple[Any, list[int]]) -> None:
            pool, indices = shard
            try:
                done = stream_shard(pool, [jobs[i] for i in indices], stream)
            except BACKEND_ERRORS as e:
                done = [_lost(op, e)] * len(indices)
            for i, outcome in zip(indices, done):
                outcomes[i] = outcome

        self._map(run, shards)
        redirected = [i for i, (status, _) in enumerate(outcomes) if status == "redirect"]
        for n, i in enumerate(redirected):
            try:
                with self._errors(op):
                    outcomes[i] = slow(jobs[i])
            except TierError as e:
                if not isinstance(e.__cause__, redis.ResponseError):
                    for j in redirected[n:]:
                        outcomes[j] = ("error", str(e))
                    break
                outcomes[i] = error_outcome(str(e.__cause__))
        return outcomes

    def _shards(self, jobs: list[Job]) -> list[tuple[Any, list[int]]]:
        """Group jobs by node, then split each group over up to ``num_connections`` workers."""
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, job in enumerate(jobs):
            pool = self._pool_of(job.rkey)
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        per_group = -(-self._num_connections // len(groups))
        shards: list[tuple[Any, list[int]]] = []
        for pool, indices in groups.values():
            num_bytes = sum(len(jobs[i].data) for i in indices)
            parts = max(1, min(per_group, len(indices), num_bytes // MIN_SHARD_BYTES))
            shards.extend((pool, indices[j::parts]) for j in range(parts))
        return shards

    def _map(self, fn: Callable[[Any], None], shards: Iterable[Any]) -> None:
        shards = list(shards)
        if len(shards) == 1:
            fn(shards[0])
            return
        futures = [self._executor.submit(fn, shard) for shard in shards]
        wait(futures)
        for future in futures:
            future.result()  # re-raises the first failure, after every shard has finished

    def _send_sets(self, jobs: list[Job], conn: Any) -> list[Outcome]:
        return send_sets(jobs, conn, self._ttl_ms)

    def _put_slow(self, job: Job) -> Outcome:
        value = bytearray(pack_header(job.key, job.data, job.desc))
        value += job.data
        try:  # a memoryview: redis-py takes a bytearray only from 8.0 on
            self._client.set(job.rkey, memoryview(value), px=self._ttl_ms)
        except OutOfMemoryError as e:
            return ("oom", str(e))
        return OK

    def _read_slow(self, job: Job) -> Outcome:
        return check_value(job.key, self._client.get(job.rkey), job.data)


def _single(result: ItemResult) -> bool:
    """The single-item form's answer: a failure raises, as ``put`` and ``read_into`` do."""
    if isinstance(result, Failed):
        raise result.error
    return result


def _lost(op: str, error: BaseException) -> Outcome:
    return ("error", f"{op}: {type(error).__name__}: {error}")
