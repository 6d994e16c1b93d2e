"""The fleet-wide throttle (common/throttle.lua) on a real Valkey, and the per-process gate."""

from __future__ import annotations

import time

import pytest
import redis

from common.throttle import FleetThrottle

TTL_MS = 60_000


def _fill(t: FleetThrottle, n: int, prefix: str = "s") -> list[str]:
    slots = []
    for i in range(n):
        assert t.acquire(f"{prefix}{i}", ttl_ms=TTL_MS).ok
        slots.append(f"{prefix}{i}")
    return slots


def test_a_fixed_cap_holds_across_callers_and_a_release_frees_a_slot(redis_client: redis.Redis) -> None:
    a, b = FleetThrottle(redis_client, max_in_flight=5), FleetThrottle(redis_client, max_in_flight=5)
    _fill(a, 3, "a")
    _fill(b, 2, "b")
    refused = a.acquire("a9", ttl_ms=TTL_MS)
    assert not refused.ok and refused.why == "limit"
    b.release("b0", "other")
    assert a.acquire("a9", ttl_ms=TTL_MS).ok
    assert a.snapshot().in_flight == 5


def test_the_rate_bucket_lets_a_second_of_requests_through_then_spaces_them(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, max_requests_per_s=10)
    for i in range(10):
        assert t.acquire(f"r{i}", ttl_ms=TTL_MS).ok
    refused = t.acquire("r10", ttl_ms=TTL_MS)
    assert not refused.ok and refused.why == "rate" and 1 <= refused.wait_ms <= 100
    time.sleep(0.12)
    assert t.acquire("r10", ttl_ms=TTL_MS).ok


def test_a_429_cuts_the_limit_once_per_congestion_event_and_pauses_the_fleet(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, cut_gap_ms=300)
    slots = _fill(t, 100)  # no cap configured: unbounded until the first 429
    assert t.snapshot().limit is None
    t.release(slots[0], "throttled", retry_after_s=0.4)
    assert t.snapshot().limit == 90  # 0.9 x the 100 that were in flight
    t.release(slots[1], "throttled")  # the same event: no second cut
    assert t.snapshot().limit == 90
    paused = t.acquire("new", ttl_ms=TTL_MS)
    assert not paused.ok and paused.why == "pause" and 300 <= paused.wait_ms <= 400
    time.sleep(0.45)
    t.release(slots[2], "throttled")  # a later event cuts again, from the limit
    assert t.snapshot().limit == 81
    snap = t.snapshot()
    assert (snap.throttled, snap.ok) == (3, 0) and snap.throttled_share == 1.0


def test_successes_at_the_limit_grow_it_by_one_per_round_trip_up_to_the_cap(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, max_in_flight=12, cut_gap_ms=0)
    slots = _fill(t, 10)
    t.release(slots[0], "throttled")  # 0.9 x 10 -> 9
    assert t.snapshot().limit == 9
    for i in range(1, 10):  # 9 answers at the limit: +1/9 each, one round trip's worth
        t.release(slots[i], "ok")
        assert t.acquire(f"again{i}", ttl_ms=TTL_MS).ok
    limit = t.snapshot().limit
    assert limit is not None and 9.9 < limit < 10.1
    held = [f"again{i}" for i in range(1, 10)]
    for i in range(300):  # a busy fleet: every freed slot is taken again at once
        if t.acquire(f"busy{i}", ttl_ms=TTL_MS).ok:
            held.append(f"busy{i}")
        else:
            t.release(held.pop(0), "ok")
    assert t.snapshot().limit == 12  # grew, and never past the configured cap
    assert t.snapshot().in_flight <= 12


def test_an_idle_fleet_does_not_grow_its_limit(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, cut_gap_ms=0)
    slots = _fill(t, 20)
    t.release(slots[0], "throttled")  # limit 18
    for s in slots[1:4]:
        t.release(s, "ok")  # still at the limit (19, 18, 17 in flight): these grow it
    at_limit = t.snapshot().limit
    assert at_limit is not None and 18 < at_limit < 18.2
    for s in slots[4:15]:
        t.release(s, "ok")  # in flight falls far below the limit: no growth
    assert t.snapshot().limit == at_limit


def test_a_dead_workers_slots_expire(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, max_in_flight=2)
    assert t.acquire("dead1", ttl_ms=100).ok and t.acquire("dead2", ttl_ms=100).ok
    assert not t.acquire("live", ttl_ms=TTL_MS).ok
    time.sleep(0.15)
    assert t.acquire("live", ttl_ms=TTL_MS).ok
    assert t.snapshot().in_flight == 1


def test_gates_of_two_processes_never_exceed_the_fleet_limit(redis_client: redis.Redis) -> None:
    gevent = pytest.importorskip("gevent")
    from workers.gate import Gate

    limit = 6
    gates = [Gate(FleetThrottle(redis_client, max_in_flight=limit)) for _ in range(2)]
    in_flight, peak, done = 0, 0, 0

    def request(gate: Gate) -> None:
        nonlocal in_flight, peak, done
        slot = gate.acquire(ttl_ms=TTL_MS)
        in_flight += 1
        peak = max(peak, in_flight)
        gevent.sleep(0.01)
        in_flight -= 1
        gate.release(slot, "ok")
        done += 1

    jobs = [gevent.spawn(request, gates[i % 2]) for i in range(60)]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert done == 60
    assert peak == limit  # the limit was used, never passed
