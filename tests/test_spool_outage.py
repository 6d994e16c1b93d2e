"""A paid answer spooled during a Redis outage counts its dollars when the spool is replayed.

tests/test_settle_replay.py covers the frozen Redis, where the buffered settle lands anyway and the
replay only must not count twice. Here Redis is really gone (stopped, then started again on its
AOF): nothing landed, so the replay is the only settle or fail there is, and the dollars the
upstream billed for the answer reach the budget (``spent``, the run's spent) and the usage counters
through it alone. A replay that settled the row without its cost would keep every row and lose the
money: budget_usd would then stop nobody.
"""

from __future__ import annotations

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
from tests.chaos import RestartableValkey
from workers.fleet.spool import fail_or_spool, pending, replay, settle_or_spool

NUSD_PER_USD = 1_000_000_000
TTL_MS = 600_000
ASK = Ask(worst_tokens=2_000, worst_nusd=50_000_000, prior_tokens=2_000)


def _usage(prompt: int, completion: int, cost: float) -> Usage:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "reasoning_tokens": 0, "cost": cost}


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[RestartableValkey]:
    """A private Valkey with AOF that this test stops and starts (never the session one)."""
    server = RestartableValkey(tmp_path / "valkey")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_answers_spooled_in_an_outage_count_their_billed_dollars_when_replayed(
    valkey: RestartableValkey, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    plain = redis.Redis.from_url(valkey.url)
    plain.set(keys.config("cfg"), "{}")  # the spool replays only into a Redis that holds the run
    open_run(plain, None, ["ds"])
    b = Budget(plain, "ds")
    b.open(1_000_000, 10.0)
    for pid, lease in (("kept", "L1"), ("failed", "L2")):
        assert b.reserve(pid, lease, ttl_ms=TTL_MS, ask=ASK).status == "ok"
    # The leases were taken before the outage: a graceful stop writes them to the AOF.
    valkey.stop()
    assert not valkey.alive()

    worker = connect(valkey.url, 1.0, socket_timeout=1.0, socket_connect_timeout=1.0)
    settled = settle_or_spool(worker, spool_dir, "cfg", Budget(worker, "ds"), "kept", "L1", 40,
                              msgpack.packb({"id": "kept"}), cost_usd=0.0123, attempts=1, within_s=1.0,
                              usage=_usage(30, 40, 0.0123))
    failed = fail_or_spool(worker, spool_dir, "cfg", Budget(worker, "ds"), "failed", "L2", "token_mismatch", 1,
                           "ids differ", where="d.jsonl:2", cost_usd=0.0045, within_s=1.0,
                           usage=_usage(20, 50, 0.0045))
    assert (settled, failed) == ("spooled", "spooled")
    assert len(pending(spool_dir)) == 2

    valkey.start()
    before = b.snapshot()
    assert before.spent_nusd == 0 and before.rows == 0  # not vacuous: nothing landed in the outage
    assert replay(worker, spool_dir) == 2
    assert not pending(spool_dir)

    billed_usd = 0.0123 + 0.0045  # what the upstream billed for the two answers
    snap = b.snapshot()
    assert (snap.rows, snap.kept_tokens) == (1, 40)
    assert snap.spent_nusd / NUSD_PER_USD == pytest.approx(billed_usd, abs=1e-9), "replayed answers lost dollars"
    assert snap.run_spent_nusd == snap.spent_nusd
    assert snap.held_nusd == 0 and snap.reserved_tokens == 0
    stats = DatasetStats(plain, "ds").read()
    assert stats.cost_usd == pytest.approx(billed_usd, abs=2e-6)
    assert (stats.billed_prompt_tokens, stats.billed_completion_tokens) == (50, 90)
    assert list(b.failures()) == ["failed"]
    worker.close()
    plain.close()


@pytest.fixture
def refusal_state() -> Iterator[None]:
    """The worker's refused-writes state (``workers/fleet/writes.py``) is per process: leave it as found."""
    from workers.fleet import writes

    yield
    writes._since = None  # the process-wide state a worker leaves on its probe's success
    writes._writable.set()


def test_an_answer_whose_settle_redis_refuses_is_spooled_and_counts_its_billed_dollars_when_replayed(
    valkey: RestartableValkey, tmp_path: Path, refusal_state: None
) -> None:
    """Redis up but refusing writes at the moment a paid answer settles: the answer goes to the
    spool, not away, and its dollars count once replayed. Without the spool write the answer was
    dropped and its prompt asked and paid again, unnoticed, and the fleet test
    (test_worker_redis_refuses) still passed (issue 37, item 6): under maxmemory a script whose
    first write is not a growing one (the settle's) is let finish, so there the settle seldom meets
    the refusal first-hand. Here the refusal is the one every write meets: a server demoted to a
    replica (as an old master after a failover) answers READONLY."""
    spool_dir = tmp_path / "spool"
    plain = redis.Redis.from_url(valkey.url)
    plain.set(keys.config("cfg"), "{}")
    open_run(plain, None, ["ds"])
    b = Budget(plain, "ds")
    b.open(1_000_000, 10.0)
    assert b.reserve("kept", "L1", ttl_ms=TTL_MS, ask=ASK).status == "ok"
    plain.execute_command("REPLICAOF", "127.0.0.1", "1")  # nobody there: it keeps its data, read-only
    try:
        worker = connect(valkey.url, 1.0, socket_timeout=1.0, socket_connect_timeout=1.0)
        settled = settle_or_spool(worker, spool_dir, "cfg", Budget(worker, "ds"), "kept", "L1", 40,
                                  msgpack.packb({"id": "kept"}), cost_usd=0.0123, attempts=1, within_s=2.0,
                                  usage=_usage(30, 40, 0.0123))
        assert settled == "spooled"
        assert len(pending(spool_dir)) == 1, "the refused settle's paid answer was not kept"
        assert b.snapshot().rows == 0  # not vacuous: Redis did refuse it
    finally:
        plain.execute_command("REPLICAOF", "NO", "ONE")
    assert replay(worker, spool_dir) == 1
    snap = b.snapshot()
    assert (snap.rows, snap.kept_tokens) == (1, 40)
    assert snap.spent_nusd / NUSD_PER_USD == pytest.approx(0.0123, abs=1e-9)
    stats = DatasetStats(plain, "ds").read()
    assert (stats.requests, stats.billed_completion_tokens) == (1, 40)
    worker.close()
    plain.close()
