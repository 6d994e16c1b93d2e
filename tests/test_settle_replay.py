"""A settle (fail, release) that runs twice counts once: billed = counted under a frozen Redis.

A worker whose settle gets no reply does not know whether it landed. While Redis is frozen
(SIGSTOP: a VM pause, a long fork) the commands wait in the server's socket buffer; the worker's
read times out, its settle goes to the spool (workers/fleet/spool.py) and Redis, once it runs again,
executes the buffered settle as well: the replay then meets a settle that already landed. The
same happens when redis-py resends a pipeline whose first send landed. Each repeat must answer
what the first answered and add nothing: no dollar, no request, no token (budget.lua's settled
markers). A genuinely second delivery (another lease) whose answer was billed again is counted
again: billed is billed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from common import keys
from common.budget import Ask, Budget, open_run
from common.contract import Usage
from common.redis_client import connect
from common.stats import DatasetStats
from harness.zygote import Zygotes
from tests.chaos import RestartableValkey
from tests.fleet import Fleet, read_summary
from workers.fleet.spool import replay, settle_or_spool

TTL_MS = 60_000
NUSD_PER_USD = 1_000_000_000


def _usage(prompt: int, completion: int, cost: float) -> Usage:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "reasoning_tokens": 0, "cost": cost}


def _opened(client: redis.Redis, name: str = "ds") -> Budget:
    open_run(client, None, [name])
    b = Budget(client, name)
    b.open(1_000_000, 10.0)
    return b


def _counts(client: redis.Redis, b: Budget) -> tuple[object, ...]:
    """Everything a repeat could add to: the dataset's and the run's dollars, holds, rows, tokens,
    the results stream, and the usage counters of the stats."""
    s = b.snapshot()
    st = DatasetStats(client, b.keys.dataset).read()
    return (s.spent_nusd, s.run_spent_nusd, s.held_nusd, s.unresolved_nusd, s.reserved_tokens, s.kept_tokens, s.rows,
            client.xlen(b.keys.results), st.requests, st.billed_prompt_tokens, st.billed_completion_tokens,
            st.cost_usd, len(b.failures()))


# --- the script, on a real server ----------------------------------------------------------------


def test_a_settle_executed_twice_counts_once_and_answers_what_it_answered(redis_client: redis.Redis) -> None:
    b = _opened(redis_client)
    ask = Ask(worst_tokens=2_000, worst_nusd=50_000_000, prior_tokens=2_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, ask=ask).status == "ok"
    row = msgpack.packb({"id": "p1"})
    assert b.settle("p1", "L1", 40, row, cost_usd=0.0123, attempts=1, usage=_usage(30, 40, 0.0123)) == "kept"
    first = _counts(redis_client, b)
    assert first[:2] == (12_300_000, 12_300_000) and first[5:9] == (40, 1, 1, 1)
    # The reply was lost (Redis frozen, the read timed out): the spool replays the same settle.
    assert b.settle("p1", "L1", 40, row, cost_usd=0.0123, attempts=1, usage=_usage(30, 40, 0.0123)) == "kept"
    assert _counts(redis_client, b) == first

    # Another delivery of the same prompt, billed again: counted (billed is billed), not kept.
    assert b.settle("p1", "L2", 41, row, cost_usd=0.01, attempts=1, usage=_usage(30, 41, 0.01)) == "duplicate"
    second = _counts(redis_client, b)
    assert second[:2] == (22_300_000, 22_300_000) and second[5:9] == (40, 1, 1, 2)
    assert b.settle("p1", "L2", 41, row, cost_usd=0.01, attempts=1, usage=_usage(30, 41, 0.01)) == "duplicate"
    assert _counts(redis_client, b) == second


def test_a_discarded_settle_repeated_stays_discarded_and_counts_once(redis_client: redis.Redis) -> None:
    open_run(redis_client, None, ["ds"])
    b = Budget(redis_client, "ds")
    b.open(100, 10.0)
    # A reaped lease's answer lands without room: billed, discarded.
    b.reserve("slow", "Ls", ttl_ms=1, ask=Ask(80, 1_000_000, 80))
    time.sleep(0.01)
    assert b.reap() == 1
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, ask=Ask(80, 1_000_000, 80)).status == "ok"
    row = msgpack.packb({"id": "slow"})
    assert b.settle("slow", "Ls", 60, row, cost_usd=0.0005, usage=_usage(5, 60, 0.0005)) == "discarded"
    first = _counts(redis_client, b)
    b.release("p1", "L1")  # the room comes back: the repeat must still not keep the row
    released = _counts(redis_client, b)
    assert b.settle("slow", "Ls", 60, row, cost_usd=0.0005, usage=_usage(5, 60, 0.0005)) == "discarded"
    assert _counts(redis_client, b) == released and released[:2] == first[:2]
    assert b.snapshot().rows == 0


def test_a_fail_and_a_release_executed_twice_count_once(redis_client: redis.Redis) -> None:
    b = _opened(redis_client)
    ask = Ask(worst_tokens=2_000, worst_nusd=50_000_000, prior_tokens=2_000)
    b.reserve("p1", "L1", ttl_ms=TTL_MS, ask=ask)
    b.reserve("p2", "L2", ttl_ms=TTL_MS, ask=ask)
    assert b.fail("p1", "L1", "token_mismatch", 1, "ids differ", cost_usd=0.002, usage=_usage(9, 9, 0.002)) == "failed"
    b.release("p2", "L2", cost_usd=0.003, usage=_usage(9, 9, 0.003))
    once = _counts(redis_client, b)
    assert once[:2] == (5_000_000, 5_000_000) and once[8] == 2
    assert b.fail("p1", "L1", "token_mismatch", 1, "ids differ", cost_usd=0.002, usage=_usage(9, 9, 0.002)) == "failed"
    b.release("p2", "L2", cost_usd=0.003, usage=_usage(9, 9, 0.003))
    assert _counts(redis_client, b) == once


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[RestartableValkey]:
    """A private Valkey with AOF, as in production: this test stops it, never the session one."""
    server = RestartableValkey(tmp_path / "valkey")
    server.start()
    pid = server._server._process.pid  # type: ignore[union-attr]
    try:
        yield server
    finally:
        os.kill(pid, signal.SIGCONT)  # a failed test must not leave a stopped server behind
        server.stop()


def test_a_settle_whose_reply_was_lost_to_a_frozen_redis_and_its_replay_count_once(
    valkey: RestartableValkey, tmp_path: Path,
) -> None:
    """The mechanism itself, on real processes: the settle is sent to a frozen server, the worker's
    read times out and it spools; the server, running again, executes the buffered settle (and
    redis-py's resend of it); then the spool replays it."""
    spool_dir = tmp_path / "spool"
    plain = redis.Redis.from_url(valkey.url)
    plain.set(keys.config("cfg"), "{}")  # the spool replays only into a Redis that holds the run
    b = _opened(plain)
    ask = Ask(worst_tokens=2_000, worst_nusd=50_000_000, prior_tokens=2_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, ask=ask).status == "ok"
    # A worker's client (common/redis_client.py), with a read timeout shorter than the settle's wait.
    worker = connect(valkey.url, 30.0, socket_timeout=1.0)
    # A pooled connection the server accepted before it froze, as a running worker's are: what the
    # worker writes on it waits in the server's buffer and runs when the server does (a connection
    # first opened during the freeze and closed by the client is dropped unread).
    worker.ping()
    pid = valkey._server._process.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        outcome = settle_or_spool(worker, spool_dir, "cfg", Budget(worker, "ds"), "p1", "L1", 40,
                                  msgpack.packb({"id": "p1"}), cost_usd=0.0123, attempts=1, within_s=2.5,
                                  usage=_usage(30, 40, 0.0123))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert outcome == "spooled"
    # The buffered settle ran once the server did: the row is kept, though nobody saw the reply.
    deadline_s = time.monotonic() + 20
    while plain.xlen(b.keys.results) < 1:
        assert time.monotonic() < deadline_s, "the buffered settle never ran"
        time.sleep(0.05)
    assert replay(worker, spool_dir) == 1
    assert not list(spool_dir.glob("*.spool"))
    counts = _counts(plain, b)
    assert counts[:2] == (12_300_000, 12_300_000), "the answer's dollars counted more than once"
    assert counts[5:9] == (40, 1, 1, 1), "kept tokens, rows, results or requests counted more than once"
    assert DatasetStats(plain, "ds").read().duplicates == 0
    worker.close()
    plain.close()


# --- the fleet, with Redis frozen past the settle's wait ------------------------------------------

#: Longer than a worker's Redis socket timeout (30 s, workers/fleet/context.py): a pipeline sent in the
#: first seconds of the freeze times out while its commands still wait in the server's buffer, so
#: its settles are spooled and also executed once Redis runs again.
FREEZE_S = 40
PROMPTS = 3_000


@pytest.fixture
def frozen_fleet(tmp_path: Path, zygotes: Zygotes | None,
                 request: pytest.FixtureRequest) -> Iterator[tuple[Fleet, RestartableValkey]]:
    valkey = RestartableValkey(tmp_path / "valkey")
    valkey.start()
    fleet = Fleet(tmp_path, valkey.url, zygotes=zygotes)
    pid = valkey._server._process.pid  # type: ignore[union-attr]
    try:
        yield fleet, valkey
    finally:
        os.kill(pid, signal.SIGCONT)  # a failed test must not leave a stopped server behind
        fleet.stop_all()
        valkey.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.all_logs())


@pytest.mark.fleet
def test_redis_frozen_past_the_settle_wait_billed_equals_counted(
    frozen_fleet: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = frozen_fleet
    fleet.start_simulator("--latency-median-ms", "300", "--latency-p99-ms", "900")
    config = fleet.one_dataset("F", PROMPTS)
    fleet.start_worker("w1", concurrency=50)
    fleet.start_worker("w2", concurrency=50)
    producer = fleet.start_producer(config)
    client = redis.Redis.from_url(valkey.url, socket_timeout=10)
    fleet.wait_rows(client, "F", 300, timeout_s=120)
    pid = valkey._server._process.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(FREEZE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert producer.wait(timeout=300) == 0, fleet.all_logs()
    spooled = fleet.log("w1").count("spooled to") + fleet.log("w2").count("spooled to")
    replayed = fleet.log("w1").count("replayed from the spool") + fleet.log("w2").count("replayed from the spool")
    fleet.assert_exactly_once(client, "F", PROMPTS)

    summary = read_summary(fleet.out, "F")
    billed = fleet.sim_stats()
    snap = Budget(client, "F").snapshot()
    print(f"spooled {spooled}, replayed {replayed}; billed {billed['billed_requests']} requests "
          f"${billed['billed_cost_usd']:.6f}; counted {summary['requests']} requests ${summary['cost_usd']:.6f}, "
          f"spent ${snap.spent_nusd / NUSD_PER_USD:.6f}")
    assert spooled > 0, "no settle was spooled: the freeze did not reach the case under test"
    assert summary["requests"] == billed["billed_requests"]
    assert summary["billed_completion_tokens"] == billed["billed_completion_tokens"]
    assert summary["billed_prompt_tokens"] == billed["billed_prompt_tokens"]
    # The stats count micro-dollars, each answer's cost rounded: exact within half of one per answer.
    assert summary["cost_usd"] == pytest.approx(billed["billed_cost_usd"], abs=PROMPTS * 0.5e-6)
    # The budget counts nano-dollars: exact.
    assert summary["spent_usd"] == pytest.approx(billed["billed_cost_usd"], abs=1e-8)
    assert snap.spent_nusd / NUSD_PER_USD == pytest.approx(billed["billed_cost_usd"], abs=1e-8)
    assert snap.run_spent_nusd == snap.spent_nusd
