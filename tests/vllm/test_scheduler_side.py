"""The scheduler half's answers and plans, against a real server (no vLLM needed).

Requests are plain records with the fields vLLM's ``Request`` has; the server is real, so
lookups, timeouts and the outage back-off are measured, not simulated.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from lmcache_svc_vllm.config import ConnectorConfig
from lmcache_svc_vllm.link import ServerLink
from lmcache_svc_vllm.scheduler import SchedulerSide
from lmcache_svc_vllm.stats import StatsRecorder

from lmcache_svc.client import CacheClient
from lmcache_svc.errors import ServerUnavailable
from lmcache_svc.keys import KVLayout, Namespace, chunk_hashes
from lmcache_svc.shm.lookup_index import STALE_S
from lmcache_svc_bench.procs import ServerProc, start_server
from tests.helpers import count_calls, wait_until

BLOCK, CHUNK = 128, 256
NAMESPACE = Namespace(
    model="tiny",
    layout=KVLayout("bfloat16", 2, 1, 32, BLOCK, "vllm-cpu/BHNC"),
    chunk_size=CHUNK,
)


def request(req_id: str, token_ids: list[int], **fields: object) -> SimpleNamespace:
    record = dict(
        request_id=req_id,
        prompt_token_ids=token_ids,
        prompt_embeds=None,
        mm_features=[],
        lora_request=None,
        cache_salt=None,
    )
    return SimpleNamespace(**{**record, **fields})


def make_scheduler(url: str, **config: object) -> tuple[SchedulerSide, StatsRecorder]:
    config.setdefault("retry_interval_s", 0.2)
    # Tests of timeouts set their own; the rest must not turn into misses on a busy machine.
    config.setdefault("lookup_timeout_ms", 2000)
    cfg = ConnectorConfig(url=url, chunk_size=CHUNK, **config)  # type: ignore[arg-type]
    stats = StatsRecorder()
    link = ServerLink(cfg, NAMESPACE, "test-scheduler")
    return SchedulerSide(cfg, [NAMESPACE], BLOCK, link, stats), stats


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("sched"))
    yield proc
    proc.cleanup()


def store_prefix(server: ServerProc, token_ids: list[int], num_chunks: int) -> None:
    hashes = chunk_hashes(NAMESPACE, token_ids)[:num_chunks]
    with CacheClient(server.socket) as client:
        ns_id = client.register_namespace(NAMESPACE)
        data = [bytes(NAMESPACE.chunk_bytes)] * len(hashes)
        assert client.store(ns_id, hashes, data) == len(hashes)


def answer(
    scheduler: SchedulerSide, req: SimpleNamespace, num_computed: int = 0
) -> tuple[int, bool]:
    """Ask as vLLM does: again on the next step while the answer is "not decided yet"."""
    deadline = time.monotonic() + 5
    while True:
        num_tokens, is_async = scheduler.get_num_new_matched_tokens(req, num_computed)
        if num_tokens is not None:
            return num_tokens, is_async
        assert time.monotonic() < deadline, "the lookup never resolved"
        time.sleep(0.001)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(n)]


def test_hit_is_chunk_aligned_and_leaves_one_token(server: ServerProc) -> None:
    scheduler, _ = make_scheduler(server.socket)
    exact = tokens(1, 2 * CHUNK)  # both chunks stored, but the last token must be computed
    store_prefix(server, exact, 2)
    assert answer(scheduler, request("exact", exact)) == (CHUNK, False)
    longer = tokens(2, 2 * CHUNK + 100)
    store_prefix(server, longer, 2)
    assert answer(scheduler, request("longer", longer)) == (2 * CHUNK, False)


def test_load_plan_starts_after_vllms_own_hit(server: ServerProc) -> None:
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(3, 2 * CHUNK + 50)
    store_prefix(server, prompt, 2)
    req = request("partial", prompt)
    # vLLM already holds 3 blocks (384 tokens): only the last block of chunk 1 is loaded.
    assert answer(scheduler, req, 3 * BLOCK) == (BLOCK, False)
    scheduler.update_state_after_alloc(req, [10, 11, 12, 13, 14], BLOCK)
    (plan,) = scheduler.build_step_plan(_empty_step()).loads
    assert (plan.first_block, plan.block_ids) == (1, (13,))
    assert plan.chunk_hashes == (tuple(chunk_hashes(NAMESPACE, prompt)[1:2]),)


def _step(
    new: dict[str, int], cached: dict[str, tuple[int, int]], blocks: dict[str, list[int]]
) -> SimpleNamespace:
    """A scheduler output: ``new`` request -> tokens scheduled; ``cached`` request ->
    (tokens computed before the step, tokens scheduled); ``blocks``: each request's blocks."""
    return SimpleNamespace(
        num_scheduled_tokens={**new, **{r: n for r, (_, n) in cached.items()}},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=0) for r in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), num_computed_tokens=[c for c, _ in cached.values()]
        ),
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: (blocks[r],)),
    )


def test_a_step_plan_says_whether_it_starts_requests(server: ServerProc) -> None:
    """The worker and the connector hold a step's stats back when it starts requests."""
    scheduler, _ = make_scheduler(server.socket)
    assert scheduler.build_step_plan(_step({"new": 10}, {}, {"new": [1]})).starts_requests
    assert not scheduler.build_step_plan(_step({}, {"old": (10, 1)}, {"old": [1]})).starts_requests
    assert not scheduler.build_step_plan(_empty_step()).starts_requests


def test_chunks_are_saved_the_step_after_they_were_computed(server: ServerProc) -> None:
    """A chunk's save never runs in the step that computed it (the request's first token
    would wait for it): the next step saves it, and a request that finished first is held."""
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(5, 3 * CHUNK + 10)
    req = request("late", prompt)
    assert answer(scheduler, req) == (0, False)  # a miss: every chunk is computed here
    hashes = tuple(chunk_hashes(NAMESPACE, prompt))
    blocks = {"late": list(range(20, 27))}
    # Step 1 computes chunks 0 and 1 (chunked prefill): nothing is saved yet.
    assert scheduler.build_step_plan(_step({"late": 2 * CHUNK}, {}, blocks)).saves == []
    # Step 2 computes the rest: it saves chunks 0 and 1, computed by step 1.
    plan = scheduler.build_step_plan(_step({}, {"late": (2 * CHUNK, CHUNK + 10)}, blocks))
    (save,) = plan.saves
    assert save.chunk_hashes == (hashes[:2],) and save.block_ids == (20, 21, 22, 23)
    assert plan.held == []
    # It finishes after step 2: chunk 2 is still to save, so vLLM must keep its blocks.
    assert scheduler.request_finished("late", len(prompt) + 1, blocks["late"])
    plan = scheduler.build_step_plan(_step({}, {}, blocks))
    (save,) = plan.saves
    assert save.chunk_hashes == (hashes[2:3],) and save.block_ids == (24, 25)
    assert plan.held == ["late"]
    assert scheduler.build_step_plan(_step({}, {}, blocks)).is_empty()  # once


def test_a_request_with_nothing_left_to_save_is_not_held(server: ServerProc) -> None:
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(6, 2 * CHUNK + 10)
    assert answer(scheduler, request("done", prompt)) == (0, False)
    blocks = {"done": list(range(5))}
    scheduler.build_step_plan(_step({"done": len(prompt)}, {}, blocks))
    (save,) = scheduler.build_step_plan(_step({}, {"done": (len(prompt), 1)}, blocks)).saves
    assert len(save.chunk_hashes[0]) == 2
    assert not scheduler.request_finished("done", len(prompt) + 2, blocks["done"])
    assert not scheduler.request_finished("unknown", 100, [])
    # A save-less engine (kv_role kv_consumer) never holds blocks.
    consumer, _ = make_scheduler(server.socket)
    consumer.save_enabled = False
    assert answer(consumer, request("c", prompt)) == (0, False)
    assert not consumer.request_finished("c", len(prompt) + 1, blocks["done"])


def test_hits_are_counted_by_the_medium_that_held_them(server: ServerProc) -> None:
    """vLLM's by-source counters get the server's answer (the tier's medium), not a name."""
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(4, 2 * CHUNK + 50)
    store_prefix(server, prompt, 2)
    req = request("media", prompt)
    assert answer(scheduler, req) == (2 * CHUNK, False)
    scheduler.update_state_after_alloc(req, [10, 11, 12, 13, 14], 2 * CHUNK)
    assert scheduler.hit_media("media", 2 * CHUNK) == {"host_memory": 2 * CHUNK}
    assert scheduler.hit_media("media", CHUNK + 1) == {"host_memory": CHUNK + 1}


def test_requests_whose_kv_is_not_a_function_of_tokens_are_skipped(server: ServerProc) -> None:
    scheduler, stats = make_scheduler(server.socket)
    prompt = tokens(4, 600)
    store_prefix(server, prompt, 2)
    for req in (
        request("salted", prompt, cache_salt="user-1"),
        request("lora", prompt, lora_request=object()),
        request("images", prompt, mm_features=[object()]),
        request("not uint32", [*prompt[:-1], 2**32]),  # no key for it: skipped, not raised
    ):
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert stats.take() is None  # not even looked up


def test_unreachable_server_is_a_fast_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection is a miss at once (no deadline waited for), and the back-off
    answers the next requests without trying the server again."""
    attempts = count_calls(monkeypatch, CacheClient, "register_namespace")
    outages = count_calls(monkeypatch, ServerLink, "_mark_down")
    scheduler, stats = make_scheduler(str(tmp_path / "nobody.sock"), retry_interval_s=3600.0)
    for i in range(20):
        assert answer(scheduler, request(f"r{i}", tokens(i, 600))) == (0, False)
    assert len(attempts) == 1, "requests in the back-off tried the server"
    ((what, error),) = outages
    assert isinstance(error, ServerUnavailable) and "UNAVAILABLE" in str(error)  # refused
    data = stats.take()
    assert data is not None and data["lookup_failures"] == 20


def test_hung_server_costs_one_timeout_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tmp_path)
    try:
        # A back-off of 1 s: the ten requests below fit in it however slow the machine is.
        scheduler, stats = make_scheduler(
            server.socket, lookup_timeout_ms=100, retry_interval_s=1.0
        )
        prompt = tokens(5, 600)
        store_prefix(server, prompt, 2)
        server_lookups = count_calls(monkeypatch, CacheClient, "lookup")
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(STALE_S + 0.05)  # under test: the lookup index stops answering once stale
        # While the lookup is out, the scheduler answers "not decided yet" (it waits at most
        # tuning.lookup_wait_ms per call); the lookup resolves as a miss at its 100 ms deadline;
        # then the back-off answers the next requests without asking the server.
        first = answers_until_decided(scheduler, request("h0", prompt))
        assert first[-1] == (0, False) and first[:-1] and set(first[:-1]) == {(None, False)}
        rest = [answers_until_decided(scheduler, request(f"h{i}", prompt)) for i in range(1, 10)]
        assert [answers[-1] for answers in rest] == [(0, False)] * 9
        assert len(server_lookups) == 1, "lookups in the back-off asked the server"
        data = stats.take()
        assert data is not None and data["lookup_failures"] == 10
        num_deferred = sum(len(answers) - 1 for answers in [first, *rest])
        assert data["lookups_deferred"] == num_deferred
        assert max(data["lookup_seconds"]) >= 0.09  # the one call waited for its deadline
        os.kill(server.proc.pid, signal.SIGCONT)
        asked = iter(range(10**9))
        wait_until(
            lambda: answer(scheduler, request(f"x{next(asked)}", prompt))[0] > 0,
            5,
            "a hit after the server resumed",
        )
        # (The hit is answered from the lookup index once it is fresh again, or by the server.)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.cleanup()


def answers_until_decided(
    scheduler: SchedulerSide, req: SimpleNamespace
) -> list[tuple[int | None, bool]]:
    """Every answer to ``req``, asked as vLLM does, up to the first that is not "not yet"."""
    answers: list[tuple[int | None, bool]] = []
    deadline = time.monotonic() + 5
    while not answers or answers[-1][0] is None:
        assert time.monotonic() < deadline, "the lookup never resolved"
        answers.append(scheduler.get_num_new_matched_tokens(req, 0))
    return answers


def _empty_step() -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        kv_connector_block_state=None,
    )


def test_a_lookup_that_raises_is_a_miss_not_an_exception_in_vllm(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, stats = make_scheduler(server.socket)
    prompt = tokens(40, 2 * CHUNK + 10)
    store_prefix(server, prompt, 2)

    def broken(*args: object) -> None:
        raise RuntimeError("lookup broke")

    def index_broken(*args: object) -> None:
        raise RuntimeError("index broke")

    # The index's answer on the scheduler's thread fails (logged): the server is asked on
    # the lookup thread, and that call fails too: a miss.
    monkeypatch.setattr(scheduler.link._client, "lookup_local", index_broken)
    monkeypatch.setattr(scheduler.link, "lookup", broken)
    assert answer(scheduler, request("broken", prompt)) == (0, False)
    data = stats.take()
    assert data is not None and data["lookup_failures"] == 1
    assert "a lookup in the shared index failed" in caplog.text and "index broke" in caplog.text
    assert "a lookup failed" in caplog.text and "lookup broke" in caplog.text


def test_a_lookup_the_index_answers_needs_no_thread(server: ServerProc) -> None:
    """Same host: the scheduler's first call has the answer, from the shared lookup index;
    the server is not asked and the lookup thread is not used."""
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(41, 2 * CHUNK + 10)
    store_prefix(server, prompt, 2)
    wait_until(lambda: scheduler.link.lookup_local(chunk_hashes(NAMESPACE, prompt)), 5, "mapped")
    calls: list[object] = []
    scheduler.link.lookup = lambda hashes: calls.append(hashes)  # type: ignore[method-assign]
    assert scheduler.get_num_new_matched_tokens(request("local", prompt), 0) == (2 * CHUNK, False)
    assert calls == []


def test_a_prompt_vllm_holds_up_to_the_cap_is_hashed_only_for_its_saves(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own prefix cache covers the prompt up to the cap: nothing can load, so the
    prompt is not hashed or looked up on its first token's path. Its first save plan (a
    step later) hashes it, and the chunks the server's index holds are not saved again."""
    scheduler, stats = make_scheduler(server.socket)
    prompt = tokens(43, 2 * CHUNK + 10)
    store_prefix(server, prompt, 1)  # the server holds chunk 0
    hashes = tuple(chunk_hashes(NAMESPACE, prompt))
    wait_until(lambda: scheduler.link.lookup_local(hashes[:1]), 5, "the index mapped")
    hashed = count_calls(monkeypatch, scheduler, "_hash")
    req = request("covered", prompt)
    assert answer(scheduler, req, 2 * CHUNK) == (0, False)
    assert hashed == [] and not (stats.take() or {}).get("lookups")
    blocks = {"covered": list(range(30, 35))}
    plan = scheduler.build_step_plan(_step({}, {"covered": (len(prompt), 1)}, blocks))
    (save,) = plan.saves
    assert save.chunk_hashes == (hashes[1:2],) and save.block_ids == (32, 33)
    assert len(hashed) == 1
    assert (
        scheduler.build_step_plan(_step({}, {"covered": (len(prompt) + 1, 1)}, blocks)).saves == []
    )


def test_a_prompt_vllm_no_longer_holds_is_looked_up_when_asked_again(server: ServerProc) -> None:
    """vLLM asks again with fewer tokens of its own (its blocks were freed while the
    request waited): then the server is asked, and its hit counts."""
    scheduler, _ = make_scheduler(server.socket)
    prompt = tokens(44, 2 * CHUNK + 10)
    store_prefix(server, prompt, 2)
    req = request("evicted", prompt)
    assert answer(scheduler, req, 2 * CHUNK) == (0, False)
    assert answer(scheduler, req, BLOCK) == (2 * CHUNK - BLOCK, False)
