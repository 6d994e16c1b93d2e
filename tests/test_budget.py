"""budget.lua on a real server: admission, exactly-once counting, leases of dead workers."""

from __future__ import annotations

import itertools
import json
import time

import msgpack
import redis

from common.budget import PRIOR_WEIGHT_ROWS, TRUST_ROWS, Budget
from common.keys import HALT

TTL_MS = 60_000


def _row(pid: str) -> bytes:
    return msgpack.packb({"id": pid})


def test_unopened_dataset_admits_nothing(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "stopped"


def test_settle_counts_once_and_hands_the_row_over_once(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10
    assert b.settle("p1", "L1", 42, _row("p1")) is True
    # A second delivery (acks_late after a crash) finishes the same prompt again.
    assert b.settle("p1", "L2", 42, _row("p1")) is False
    snap = b.snapshot()
    assert (snap.kept, snap.rows, snap.reserved, snap.in_flight) == (42, 1, 0, 0)
    assert redis_client.xlen(b.keys.results) == 1
    assert b.reserve("p1", "L3", ttl_ms=TTL_MS, prior_estimate=10).status == "done"


def test_live_lease_makes_a_second_delivery_wait(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    second = b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    assert second.status == "busy" and 0 < second.value <= TTL_MS
    # The same delivery asking again keeps its admission instead of reserving twice.
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10


def test_expired_lease_is_taken_over_without_leaking_budget(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "dead", ttl_ms=1, prior_estimate=10).status == "ok"
    time.sleep(0.01)
    assert b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10
    # The dead worker's late settle still counts (paid work), and only once.
    assert b.settle("p1", "dead", 7, _row("p1")) is True
    assert b.settle("p1", "L2", 7, _row("p1")) is False
    snap = b.snapshot()
    assert (snap.kept, snap.reserved, snap.in_flight) == (7, 0, 0)


def test_reap_returns_estimates_of_expired_leases(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=1, prior_estimate=10)
    b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    time.sleep(0.01)
    assert b.reap() == 1
    snap = b.snapshot()
    assert (snap.reserved, snap.in_flight) == (10, 1)


def test_a_full_budget_parks_requests_until_the_estimate_is_trusted(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(100)
    statuses = [b.reserve(f"p{i}", f"L{i}", ttl_ms=TTL_MS, prior_estimate=30).status for i in range(4)]
    assert statuses == ["ok", "ok", "ok", "wait"]  # committed, but the guess of 30 may be wrong
    b.settle("p0", "L0", 35, _row("p0"))
    assert b.reserve("p3", "L3", ttl_ms=TTL_MS, prior_estimate=30).status == "wait"
    b.settle("p1", "L1", 35, _row("p1"))
    b.settle("p2", "L2", 35, _row("p2"))
    # Kept alone leaves no room for another request: the dataset is done for good.
    assert b.reserve("p3", "L3", ttl_ms=TTL_MS, prior_estimate=30).status == "over"
    assert b.snapshot().state == "exhausted"
    assert b.reserve("p4", "L4", ttl_ms=TTL_MS, prior_estimate=30).status == "stopped"


def test_estimate_moves_from_the_prior_to_the_measured_mean(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(10_000_000)
    estimates = []
    for i in range(20 * PRIOR_WEIGHT_ROWS):
        r = b.reserve(f"p{i}", "L", ttl_ms=TTL_MS, prior_estimate=1000)
        estimates.append(r.value)
        b.settle(f"p{i}", "L", 100, _row(f"p{i}"))
    assert estimates[0] == 1000
    assert all(a >= b for a, b in itertools.pairwise(estimates))
    assert estimates[-1] < 150  # within 50% of the mean after 20 prior-weights of rows


def test_in_flight_requests_are_projected_with_the_current_estimate(redis_client: redis.Redis) -> None:
    """A low prior let many requests in; once rows show they are big, admission waits for them."""
    b = Budget(redis_client, "ds")
    b.open(12_100)
    for i in range(10):
        assert b.reserve(f"early{i}", "L", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    for i in range(TRUST_ROWS):
        assert b.reserve(f"big{i}", "L", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
        b.settle(f"big{i}", "L", 400, _row(f"big{i}"))
    # kept 8,000, mean 365, length-biased mean 399: 10 in flight project to 3,990, and
    # 8,000 + 3,990 + 365 > 12,100, though their own reservations (10 × 10) would have let it in.
    assert b.reserve("late", "L", ttl_ms=TTL_MS, prior_estimate=10).status == "over"


def test_a_renewal_keeps_an_admitted_request_alive_after_exhaustion(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(130)
    assert b.reserve("p0", "L0", ttl_ms=TTL_MS, prior_estimate=60).status == "ok"
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=60).status == "ok"
    b.settle("p0", "L0", 80, _row("p0"))
    assert b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=60).status == "over"
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=60).status == "ok"  # its retry goes on
    b.close()
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=60).status == "stopped"


def test_failure_is_recorded_and_cleared_when_kept_later(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10)
    assert b.fail("p1", "L1", "retries_exhausted", 6, "http_429: slow down") is True
    assert b.failures()["p1"]["reason"] == "retries_exhausted"
    assert b.snapshot().reserved == 0
    b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    b.settle("p1", "L2", 5, _row("p1"))
    assert b.failures() == {}


def test_open_rederives_reserved_and_resumes_counts(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10)
    b.settle("p1", "L1", 50, _row("p1"))
    p2 = b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    redis_client.hset(b.keys.budget, "reserved", 999)  # as if a crash left it wrong
    assert b.open(5_000) == (50, 1)
    snap = b.snapshot()
    assert (snap.limit, snap.reserved, snap.state) == (5_000, p2.value, "active")


# --- promises held by the mutation check (tests/mutants.toml): each fails when its promise breaks ---


def test_a_late_failure_of_a_kept_prompt_records_nothing(redis_client: redis.Redis) -> None:
    """Two deliveries of one prompt: one keeps the row, the other's request then fails."""
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "first", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.settle("p1", "first", 42, _row("p1")) is True
    assert b.fail("p1", "second", "retries_exhausted", 6, "http_502: upstream") is False
    assert b.failures() == {}
    assert redis_client.hlen(b.keys.failed) == 0
    snap = b.snapshot()
    assert (snap.kept, snap.rows, snap.reserved, snap.in_flight) == (42, 1, 0, 0)


def test_the_stop_waits_while_more_requests_are_in_flight_than_rows_landed(redis_client: redis.Redis) -> None:
    """Enough rows to trust the mean (TRUST_ROWS), but fewer than are in flight: those landed first
    are the short answers, so a full budget parks the request instead of ending the dataset."""
    b = Budget(redis_client, "ds")
    b.open(10**9)
    in_flight = TRUST_ROWS + 10
    for i in range(in_flight):
        assert b.reserve(f"long{i}", "L", ttl_ms=TTL_MS, prior_estimate=100).status == "ok"
    for i in range(TRUST_ROWS):
        assert b.reserve(f"short{i}", "L", ttl_ms=TTL_MS, prior_estimate=100).status == "ok"
        assert b.settle(f"short{i}", "L", 10, _row(f"short{i}"))
    b.open(1_000)  # the same state under a limit the in-flight projection does not fit
    snap = b.snapshot()
    assert (snap.rows, snap.in_flight, snap.kept) == (TRUST_ROWS, in_flight, 10 * TRUST_ROWS)
    # kept (200) + one estimate fits under 1,000, 30 in flight projected at ~85 each do not.
    assert b.reserve("next", "L", ttl_ms=TTL_MS, prior_estimate=100).status == "wait"
    assert b.snapshot().state == "active"


def test_a_halted_account_admits_nothing_and_frees_the_lease(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    b.halt("http_402", "Insufficient credits", "worker-1")
    assert json.loads(redis_client.get(HALT) or b"{}")["reason"] == "http_402"
    assert b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10).status == "halted"
    # The holder's renewal before a retry is refused too, and its admission goes back.
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "halted"
    snap = b.snapshot()
    assert (snap.reserved, snap.in_flight, snap.state) == (0, 0, "active")
    redis_client.delete(HALT)  # what the next producer run does once the key or credits are fixed
    assert b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
