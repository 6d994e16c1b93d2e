"""The fleet-wide throttle on a real fleet: 2 celery workers, Redis, the simulator in capacity mode.

Each promise is read where it shows: in the simulator's counters and in-flight series (what the
provider saw), not in the throttle's own state.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import requests

from common.throttle import FleetThrottle
from tests.fleet import Fleet, read_summary

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

SERIES_S = 0.1


#: The default (common/config.py ThrottleLimits), said here to be plain.
ADAPTIVE = "temperature = 1.0\nadaptive_backoff = true"


def _series(fleet: Fleet) -> list[dict[str, float]]:
    raw = requests.get(fleet.sim_url + "/_sim/stats?series=1", timeout=10).json()["series"]
    return [dict(zip(raw["columns"], row, strict=True)) for row in raw["rows"]]


def _run(fleet: Fleet, n: int, *, workers: int = 2, greenlets: int = 40, request: str = "",
         max_attempts: int = 8) -> dict[str, Any]:
    config = fleet.one_dataset("T", n, max_attempts=max_attempts, request=request or "temperature = 1.0")
    for i in range(workers):
        fleet.start_worker(f"w{i + 1}", concurrency=greenlets)
    fleet.run_producer(config, timeout_s=240)
    return read_summary(fleet.out, "T")


@contextmanager
def _limits_sampled(client: redis.Redis, *, every_s: float) -> Iterator[list[float]]:
    """The fleet's throttle limit every ``every_s`` while requests are in flight, for the block's length."""
    limits: list[float] = []
    sampling = threading.Event()

    def sample() -> None:
        throttle = FleetThrottle(client)
        while not sampling.wait(every_s):
            snap = throttle.snapshot()
            if snap.in_flight and snap.limit is not None:
                limits.append(snap.limit)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield limits
    finally:
        sampling.set()
        sampler.join(timeout=5)


@pytest.mark.long
def test_a_fleet_over_a_providers_capacity_keeps_its_429s_few_and_its_limit_near_it(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """80 greenlets against a capacity of 30: without the shared limit each greenlet learns alone,
    and a quarter of all requests are answered 429 (measured with the gate bypassed: 24.8%)."""
    capacity, n = 30, 1200
    fleet.start_simulator("--latency-median-ms", "300", "--capacity-in-flight", str(capacity),
                          "--capacity-retry-after-s", "1")
    # The limit as it stood through the run, not only at its end: a probe's 429 in the last second
    # cuts it with nothing after to grow it back (seen once inside the whole suite: 20 at the end).
    with _limits_sampled(redis_client, every_s=0.2) as limits:
        summary = _run(fleet, n, request=ADAPTIVE)
    fleet.assert_exactly_once(redis_client, "T", n)
    assert summary["failed"] == 0
    sim = fleet.sim_stats()
    share = sim["capacity_429s"] / sim["requests"]
    print(f"429s {sim['capacity_429s']} of {sim['requests']} requests ({share:.1%}); "
          f"throttle {summary['throttle']}")
    # The first wave (80 greenlets at once, before any 429 taught the fleet) is up to 50 of them,
    # whatever the fleet does; after it the fleet probes above the capacity once in a while, a 429 or
    # two each time. Judged on those probes: all 429s were 4.5% run alone (3 runs), 8.5% and 12.0%
    # inside the whole suite (6 test processes on 2 cores: slower reactions, a 429 per late one),
    # i.e. probes 0.8%, 4.9% and 8.4%; with the shared limit bypassed all 429s were 24.8% (~21% probes).
    first_wave = 2 * 40 - capacity
    probes = max(0, sim["capacity_429s"] - first_wave) / sim["requests"]
    assert probes < 0.10, f"{probes:.1%} of requests were 429s after the first wave"
    assert summary["throttle"]["throttled"] == sim["capacity_429s"]  # the fleet counted what it got
    assert summary["throttle"]["limit"] is not None
    learned = limits[len(limits) // 4:]  # after the first quarter of the run: the first wave's lesson
    assert learned, "the throttle's limit was never seen while requests were in flight"
    median = statistics.median(learned)
    print(f"limit while busy: median {median:.1f}, {min(learned):.1f}..{max(learned):.1f} over {len(learned)} samples")
    assert 0.8 * capacity <= median <= 1.25 * capacity, learned


def test_a_retry_after_pauses_every_worker_for_that_long(fleet: Fleet) -> None:
    """The first 429 (Retry-After: 3) must stop new requests from both workers for 3 s; without a
    shared pause the other greenlets would send ~20 requests per 0.1 s meanwhile."""
    pause_s = 3.0
    fleet.start_simulator("--latency-median-ms", "200", "--capacity-in-flight", "20",
                          "--capacity-retry-after-s", str(pause_s), "--series-interval-s", str(SERIES_S))
    summary = _run(fleet, 400, greenlets=30, request=ADAPTIVE)
    assert summary["results"] == 400
    rows = _series(fleet)
    first_429 = next(r["t_s"] for r in rows if r["capacity_429"] > 0)
    # Requests already on their way when the pause was set still arrive: allow 1 s for them (four
    # test processes on two cores can hold a sent request that long).
    quiet = [r for r in rows if first_429 + 1.0 <= r["t_s"] < first_429 + pause_s - SERIES_S]
    assert len(quiet) >= 15
    assert sum(r["requests"] for r in quiet) == 0, [(r["t_s"], r["requests"]) for r in quiet if r["requests"]]
    resumed = [r for r in rows if first_429 + pause_s <= r["t_s"] < first_429 + pause_s + 1.5]
    assert sum(r["requests"] for r in resumed) > 0  # and then it goes on


def test_a_worker_holds_its_concurrency_in_requests_and_its_extra_greenlets_wait_on_redis(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """SPECFLEET_CONCURRENCY is requests in flight per worker, whatever its pool's extra greenlets
    (common/worker_cmd.pool_size) are doing: the simulator never sees more, and sees that many."""
    concurrency, n = 8, 160
    fleet.start_simulator("--latency-median-ms", "300")
    summary = _run(fleet, n, workers=1, greenlets=concurrency)
    fleet.assert_exactly_once(redis_client, "T", n)
    assert summary["failed"] == 0
    sim = fleet.sim_stats()
    assert sim["max_in_flight"] <= concurrency, sim["max_in_flight"]
    assert sim["max_in_flight"] == concurrency  # and the slots were used


def test_max_in_flight_caps_the_whole_fleet(fleet: Fleet, redis_client: redis.Redis) -> None:
    cap, n = 7, 240
    fleet.start_simulator("--latency-median-ms", "100")
    summary = _run(fleet, n, greenlets=20, request=f"temperature = 1.0\nmax_in_flight = {cap}")
    fleet.assert_exactly_once(redis_client, "T", n)
    sim = fleet.sim_stats()
    assert sim["max_in_flight"] <= cap  # 40 greenlets on 2 workers, never more than the cap at once
    assert sim["max_in_flight"] >= cap - 1  # and the cap was what held them back
    assert summary["throttle"]["limit"] == cap


def test_max_requests_per_s_caps_the_fleets_rate(fleet: Fleet) -> None:
    rate, n = 20, 120
    fleet.start_simulator("--latency-median-ms", "50", "--series-interval-s", str(SERIES_S))
    summary = _run(fleet, n, greenlets=20, request=f"temperature = 1.0\nmax_requests_per_s = {rate}")
    assert summary["results"] == n
    # Over the run, requests started at most the cap's rate (a bucket of one: 1/rate apart). The
    # run as a whole, not its busiest second at the simulator: a simulator starved of CPU on a busy
    # box records a backlog of arrivals late, in one bucket (seen in CI: 52 "in one second" while
    # the run held 20/s). Uncapped, 20 greenlets at 50 ms send the 120 in well under a second.
    starts = sorted(r["start_s"] for r in fleet.sim_requests())
    assert len(starts) == n
    mean_rate = (n - 1) / (starts[-1] - starts[0])
    assert mean_rate <= rate * 1.05, mean_rate
    per_bucket = [r["requests"] for r in _series(fleet)]
    window = round(1 / SERIES_S)
    busiest = max(sum(per_bucket[i:i + window]) for i in range(max(1, len(per_bucket) - window + 1)))
    assert busiest >= rate - 2  # and the cap, not the fleet, was the limit


def test_random_429s_are_learned_as_background_and_do_not_hold_the_fleet_back(fleet: Fleet) -> None:
    """A provider refusing 10% of requests whatever the load (Retry-After 1 s): the fleet checks
    its first cut, sees the share did not fall, undoes it and goes on at full width (a fleet that
    read every 429 as congestion was cut to its floor of 4 in flight here)."""
    fleet.start_simulator("--latency-median-ms", "300", "--fault", "429=0.1")
    summary = _run(fleet, 1500, request=ADAPTIVE)
    assert summary["results"] == 1500 and summary["failed"] == 0
    throttle = summary["throttle"]
    assert 0.05 < throttle["throttled_share"] < 0.15
    # Learned as background (a check found the share did not fall); the limit at the very end may be
    # a cut still being checked, so it is not what this test reads.
    assert throttle["background_share"] > 0.02, throttle  # ~0.1, halving every 2 min after it was learned


#: The three accounts of issue 36's table: the balance unknown (/credits answers 403 to a key that
#: is not the management key), known and far from binding ($1M), and a key with a $30 spending limit.
ACCOUNTS = {
    "balance-unknown": ("--balance-usd", "1000000", "--management-key", "not-the-runs-key"),
    "balance-known": ("--balance-usd", "1000000"),
    "key-limit-30usd": ("--credit-limit-usd", "30", "--management-key", "not-the-runs-key"),
}


@pytest.mark.long
@pytest.mark.parametrize("account", list(ACCOUNTS))
def test_a_capacity_limit_holds_the_fleet_near_it_whatever_the_account_knows(
        fleet: Fleet, redis_client: redis.Redis, account: str) -> None:
    """Issue 36's regression: with the balance known, the first 429's cut turned the one in-flight
    limit into a balance rule that each answer drained, and the fleet sank to 5 in flight for good
    (2,097 of 4,000 kept in 397 s). The capacity window (429s) and the balance bound (dollars) are
    kept apart: every account row keeps every prompt, with few 429s, in about the time the
    provider's capacity allows."""
    capacity, n = 30, 900
    fleet.start_simulator("--latency-median-ms", "1000", "--latency-p99-ms", "1300", "--capacity-in-flight",
                          str(capacity), "--capacity-retry-after-s", "1", *ACCOUNTS[account])
    with _limits_sampled(redis_client, every_s=0.5) as limits:
        summary = _run(fleet, n, greenlets=30, request=ADAPTIVE)
    fleet.assert_exactly_once(redis_client, "T", n)
    assert summary["results"] == n and summary["failed"] == 0, summary
    snap = FleetThrottle(redis_client).snapshot()
    if account != "balance-unknown":  # the plan read a balance or a key limit: the balance bound is set
        assert snap.balance_limit is not None and snap.balance_limit > capacity, snap
    else:
        assert snap.balance_limit is None, snap
    sim = fleet.sim_stats()
    share = sim["capacity_429s"] / sim["requests"]
    served = [r for r in fleet.sim_requests() if r["status"] == 200]
    wall_s = max(r["end_s"] for r in served) - min(r["start_s"] for r in served)
    allowed_s = sum(r["end_s"] - r["start_s"] for r in served) / capacity
    late = limits[len(limits) // 2:]
    print(f"{account}: 429s {share:.1%} of {sim['requests']}; kept {summary['results']}/{n}; wall {wall_s:.1f} s "
          f"(capacity allows {allowed_s:.1f} s, {wall_s / allowed_s:.2f}x); limit over time "
          f"{[round(x) for x in limits[::max(1, len(limits) // 8)]]}; {snap}")
    assert share < 0.05, share
    # The collapse this guards against held the fleet at 4-5 in flight: the run took 6x and more.
    assert late and min(late) >= 0.6 * capacity, limits
    assert wall_s <= 1.3 * allowed_s, (wall_s, allowed_s)
