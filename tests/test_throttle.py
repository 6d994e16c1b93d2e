"""The fleet-wide throttle (common/throttle.lua) on a real Valkey, and the per-process gate."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
import redis

from common.config import ThrottleLimits
from common.throttle import POLICY, FleetThrottle, SlotGrant, ThrottlePolicy
from tests.throttle_sim import T0_MS, Provider, run_fleet

TTL_MS = 60_000


def _frozen() -> int:
    """A clock that stands still: the mechanics below happen within one instant."""
    return T0_MS


def _eager(**changes: float) -> ThrottlePolicy:
    """The cut's mechanics on a handful of slots: judge a 429 from the first answer on, with no
    allowance for chance (the judging itself, on realistic traffic, is what the simulated fleets
    below test)."""
    return replace(POLICY, min_requests=0, check_requests=0, window_ms=0, noise_z=0, margin=0, **changes)


def _fill(t: FleetThrottle, n: int, prefix: str = "s", limits: ThrottleLimits | None = None) -> list[str]:
    slots = []
    for i in range(n):
        assert t.acquire(f"{prefix}{i}", ttl_ms=TTL_MS, limits=limits or ThrottleLimits()).ok
        slots.append(f"{prefix}{i}")
    return slots


def test_a_fixed_cap_holds_across_callers_and_a_release_frees_a_slot(redis_client: redis.Redis) -> None:
    cap = ThrottleLimits(max_in_flight=5)
    a, b = FleetThrottle(redis_client), FleetThrottle(redis_client)
    _fill(a, 3, "a", cap)
    _fill(b, 2, "b", cap)
    refused = a.acquire("a9", ttl_ms=TTL_MS, limits=cap)
    assert not refused.ok and refused.why == "limit"
    b.release("b0", "other", ttl_ms=TTL_MS, limits=cap)
    assert a.acquire("a9", ttl_ms=TTL_MS, limits=cap).ok
    assert a.snapshot().in_flight == 5


def test_a_run_held_for_its_plan_starts_nothing_until_unheld_and_a_reset_without_hold_frees_it(
    redis_client: redis.Redis,
) -> None:
    t, cap = FleetThrottle(redis_client), ThrottleLimits(max_in_flight=5)
    t.reset(cap, hold=True)
    held = t.acquire_many(["h0", "h1"], ttl_ms=TTL_MS, limits=cap)
    assert not held.ok and held.why == "hold"
    assert t.snapshot().in_flight == 0
    t.unhold()
    assert t.acquire_many(["h0", "h1"], ttl_ms=TTL_MS, limits=cap).granted == 2
    t.reset(cap, hold=True)  # a run held for its plan keeps the slots of requests already in flight
    assert t.snapshot().in_flight == 2 and not t.acquire("h2", ttl_ms=TTL_MS, limits=cap).ok
    t.reset(cap)  # the next run, started without a plan (--no-plan), is not held by an old one
    assert t.acquire("h2", ttl_ms=TTL_MS, limits=cap).ok


def test_the_rate_cap_spaces_requests_so_no_second_holds_more_than_the_cap(redis_client: redis.Redis) -> None:
    t, rate = FleetThrottle(redis_client), ThrottleLimits(max_requests_per_s=10)
    assert t.acquire("r0", ttl_ms=TTL_MS, limits=rate).ok
    refused = t.acquire("r1", ttl_ms=TTL_MS, limits=rate)
    assert not refused.ok and refused.why == "rate" and 90 <= refused.wait_ms <= 100
    granted, start = 1, time.monotonic()
    while time.monotonic() - start < 1.0:  # a second of asking as fast as possible
        granted += t.acquire_many([f"m{granted}-{i}" for i in range(5)], ttl_ms=TTL_MS, limits=rate).granted
    assert 10 <= granted <= 11


def test_a_429_cuts_the_limit_once_per_congestion_event_and_pauses_the_fleet(redis_client: redis.Redis) -> None:
    now = [T0_MS]
    # The check keeps every cut and learns no background here (what a check decides is the simulations' part).
    policy = _eager(cut_gap_ms=300, beta=0.9, check_ratio=100, background_max=0)
    t = FleetThrottle(redis_client, policy, clock_ms=lambda: now[0])
    slots = _fill(t, 100)  # no cap configured: unbounded until the first 429
    assert t.snapshot().limit is None
    t.release(slots[0], "throttled", ttl_ms=TTL_MS, retry_after_s=0.4)
    assert t.snapshot().limit == 89  # 0.9 x the 99 of the 100 in flight the provider did not refuse
    t.release(slots[1], "throttled", ttl_ms=TTL_MS)  # the same event: one more refused, not a second 10% cut
    assert t.snapshot().limit == 88
    paused = t.acquire("new", ttl_ms=TTL_MS)
    assert not paused.ok and paused.why == "pause" and paused.wait_ms == 400
    now[0] += 400 + POLICY.window_ms  # past the pause and one window of checking the cut
    for s in slots[2:13]:
        t.release(s, "other", ttl_ms=TTL_MS)  # 87 in flight: room under the limit of 88 for one more
    assert t.acquire("after", ttl_ms=TTL_MS).ok
    t.release("after", "throttled", ttl_ms=TTL_MS)  # the cut is checked and kept, and a later event
    assert t.snapshot().limit == 78  # cuts again: 0.9 x the 87 of 88 in flight not refused
    snap = t.snapshot()
    assert (snap.throttled, snap.ok) == (3, 0) and snap.throttled_share == 1.0


def test_429s_that_reach_the_throttle_seconds_after_their_requests_started_still_cut(
        redis_client: redis.Redis) -> None:
    """On a starved host a 429 can reach the throttle seconds after its slot was granted: it still
    counts in the recent share (it was left out, and a fleet sent at 60% 429s without one cut)."""
    now = [T0_MS]
    t = FleetThrottle(redis_client, clock_ms=lambda: now[0])  # the real policy: windows, noise, margins
    early = _fill(t, 100, "early")
    now[0] += 3 * POLICY.window_ms  # both windows have passed since those started
    _fill(t, 40, "late")  # the fleet goes on starting requests meanwhile
    for s in early[:30]:
        t.release(s, "throttled", ttl_ms=TTL_MS)
    assert t.snapshot().limit is not None  # cut: no longer unbounded


def test_a_burst_far_over_the_capacity_lands_near_it_in_one_event(redis_client: redis.Redis) -> None:
    """1,500 requests start at once against a provider that serves 300: the 1,200 it refuses are
    one congestion event, and the limit lands at beta x 300, not at beta x 1,500 (which would take
    dozens of events of hundreds of 429s each to come down)."""
    t = FleetThrottle(redis_client, clock_ms=_frozen, policy=_eager(cut_gap_ms=60_000))
    slots = _fill(t, 1500)
    for s in slots[300:]:
        t.release(s, "throttled", ttl_ms=TTL_MS, retry_after_s=1)
    assert t.snapshot().limit == int(POLICY.beta * 300)
    assert t.snapshot().in_flight == 300


def test_successes_at_the_limit_grow_it_by_one_per_round_trip_up_to_the_cap(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, clock_ms=_frozen, policy=_eager(cut_gap_ms=0, beta=0.9))
    cap = ThrottleLimits(max_in_flight=12)
    slots = _fill(t, 11, limits=cap)
    t.release(slots[0], "throttled", ttl_ms=TTL_MS, limits=cap)  # 0.9 x the 10 not refused -> 9
    assert t.snapshot().limit == 9
    held = slots[1:]
    for s in held[:2]:  # 10 in flight over the limit of 9: drain to it (answers at the limit grow it)
        t.release(s, "ok", ttl_ms=TTL_MS, limits=cap)
    held = held[2:]
    grown = t.snapshot().limit
    assert grown is not None and 9.2 < grown < 9.3  # 9 + 1/9 + 1/9.1
    for i in range(9):  # a round trip at the limit: 9 answers, each slot taken again at once
        t.release(held.pop(0), "ok", ttl_ms=TTL_MS, limits=cap)
        assert t.acquire(f"again{i}", ttl_ms=TTL_MS, limits=cap).ok
        held.append(f"again{i}")
    limit = t.snapshot().limit
    assert limit is not None and 9.95 < limit < 10.15  # about one more per round trip
    for i in range(300):  # a busy fleet: every freed slot is taken again at once
        if t.acquire(f"busy{i}", ttl_ms=TTL_MS, limits=cap).ok:
            held.append(f"busy{i}")
        else:
            t.release(held.pop(0), "ok", ttl_ms=TTL_MS, limits=cap)
    assert t.snapshot().limit == 12  # grew, and never past the configured cap
    assert t.snapshot().in_flight <= 12


def test_an_idle_fleet_does_not_grow_its_limit(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, clock_ms=_frozen, policy=_eager(cut_gap_ms=0, beta=0.9))
    slots = _fill(t, 21)
    t.release(slots[0], "throttled", ttl_ms=TTL_MS)  # limit 0.9 x 20 = 18
    for s in slots[1:5]:
        t.release(s, "ok", ttl_ms=TTL_MS)  # still at the limit (20 … 17 in flight): these grow it
    at_limit = t.snapshot().limit
    assert at_limit is not None and 18.1 < at_limit < 18.3
    for s in slots[5:16]:
        t.release(s, "ok", ttl_ms=TTL_MS)  # in flight falls far below the limit: no growth
    assert t.snapshot().limit == at_limit


def test_a_busy_fleet_a_few_short_of_a_large_limit_still_grows_it(redis_client: redis.Redis) -> None:
    """Slots freed in one process are refilled by another only after its next poll: a busy fleet
    of 300 sits a few under its limit, and its answers must still grow it."""
    t = FleetThrottle(redis_client, clock_ms=_frozen, policy=_eager(cut_gap_ms=0, beta=0.9))
    slots = _fill(t, 301)
    t.release(slots.pop(), "throttled", ttl_ms=TTL_MS)  # 0.9 x 300 = 270
    for s in slots[:35]:
        t.release(s, "ok", ttl_ms=TTL_MS)  # 300 … 266 in flight: growth while at least 97% of 270 (261.9)
    limit = t.snapshot().limit
    assert limit is not None and 270 + 34 / 271 < limit < 270 + 36 / 270


def test_a_dead_workers_slots_expire_and_their_late_answers_count_for_nothing(redis_client: redis.Redis) -> None:
    t, cap = FleetThrottle(redis_client), ThrottleLimits(max_in_flight=2)
    assert t.acquire("dead1", ttl_ms=100, limits=cap).ok and t.acquire("dead2", ttl_ms=100, limits=cap).ok
    assert not t.acquire("live", ttl_ms=TTL_MS, limits=cap).ok
    time.sleep(0.15)
    assert t.acquire("live", ttl_ms=TTL_MS, limits=cap).ok
    assert t.snapshot().in_flight == 1
    t.release("dead1", "throttled", ttl_ms=TTL_MS, limits=cap)  # expired: neither counted nor cutting
    snap = t.snapshot()
    assert (snap.throttled, snap.limit, snap.in_flight) == (0, None, 1)


def test_reset_forgets_the_limit_and_counters_but_not_the_requests_in_flight(redis_client: redis.Redis) -> None:
    t = FleetThrottle(redis_client, clock_ms=_frozen, policy=_eager())
    slots = _fill(t, 10)
    t.release(slots[0], "throttled", ttl_ms=TTL_MS, retry_after_s=5)
    t.reset()
    snap = t.snapshot()
    assert (snap.limit, snap.throttled, snap.pause_ms_left, snap.in_flight) == (None, 0, 0, 9)
    t.reset(ThrottleLimits(max_in_flight=50))  # the run's cap, for readers that have no config
    assert t.snapshot().limit == 50


def test_gates_of_two_processes_never_exceed_the_fleet_limit(redis_client: redis.Redis) -> None:
    gevent = pytest.importorskip("gevent")
    from workers.fleet.gate import Gate

    limit = 6
    cap = ThrottleLimits(max_in_flight=limit)
    gates = [Gate(FleetThrottle(redis_client)) for _ in range(2)]
    in_flight, peak, done = 0, 0, 0

    def request(gate: Gate) -> None:
        nonlocal in_flight, peak, done
        with gate.slot(ttl_ms=TTL_MS, limits=cap):
            in_flight += 1
            peak = max(peak, in_flight)
            gevent.sleep(0.01)
            in_flight -= 1
        done += 1

    jobs = [gevent.spawn(request, gates[i % 2]) for i in range(60)]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert done == 60
    assert peak == limit  # the limit was used, never passed


def test_a_gate_holds_its_process_to_its_own_cap_under_an_unbounded_fleet(redis_client: redis.Redis) -> None:
    gevent = pytest.importorskip("gevent")
    from workers.fleet.gate import Gate

    gate = Gate(FleetThrottle(redis_client), max_in_flight=5, borrow_up_to=7)  # no fixed cap: no borrowing
    in_flight, peak, done = 0, 0, 0

    def request() -> None:
        nonlocal in_flight, peak, done
        with gate.slot(ttl_ms=TTL_MS):
            in_flight += 1
            peak = max(peak, in_flight)
            gevent.sleep(0.01)
            in_flight -= 1
        done += 1

    jobs = [gevent.spawn(request) for _ in range(60)]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert (done, peak, gate.held) == (60, 5, 0)


def test_a_share_that_found_no_slot_keeps_borrowers_off_until_it_is_served(redis_client: redis.Redis) -> None:
    """The script's side of lending: a caller within its share (keep_free 0) that finds the cap full
    marks the fleet wanting; for WANT_MS (250 ms) a borrower (keep_free > 0) gets nothing, however many
    slots free meanwhile, and after it a borrower takes all but keep_free of what is free."""
    now = [T0_MS]
    t = FleetThrottle(redis_client, clock_ms=lambda: now[0])
    cap = ThrottleLimits(max_in_flight=10)
    held = _fill(t, 10, limits=cap)
    assert t.acquire_many(["b0"], ttl_ms=TTL_MS, limits=cap) == SlotGrant(False, 0, "limit")  # b wants
    for slot in held[:4]:
        t.release(slot, "ok", ttl_ms=TTL_MS, limits=cap)
    now[0] += 100
    assert not t.acquire_many(["a0", "a1"], ttl_ms=TTL_MS, limits=cap, keep_free=1).ok  # 4 free, b's
    assert t.acquire_many(["b0", "b1", "b2"], ttl_ms=TTL_MS, limits=cap).granted == 3
    now[0] += 200  # b's want is 300 ms old
    assert t.acquire_many(["a0", "a1"], ttl_ms=TTL_MS, limits=cap, keep_free=1).ok is False  # 1 free, kept
    t.release(held[4], "ok", ttl_ms=TTL_MS, limits=cap)
    assert t.acquire_many(["a0", "a1", "a2"], ttl_ms=TTL_MS, limits=cap, keep_free=1).granted == 1  # 2 free


def test_a_share_giving_slots_back_with_requests_waiting_keeps_borrowers_off_them(redis_client: redis.Redis) -> None:
    """The moment between a process's release and its next ask: released "wanting" (its share not
    full, requests queued), the slots wait for it; released otherwise, a borrower may take them."""
    from common.throttle import Release

    now = [T0_MS]
    t = FleetThrottle(redis_client, clock_ms=lambda: now[0])
    cap = ThrottleLimits(max_in_flight=10)
    held = _fill(t, 10, limits=cap)
    t.release_many([Release(slot, "ok", TTL_MS, None, cap) for slot in held[:5]], wanting=True)
    assert not t.acquire_many(["b0", "b1"], ttl_ms=TTL_MS, limits=cap, keep_free=1).ok
    assert t.acquire_many([f"a{i}" for i in range(5)], ttl_ms=TTL_MS, limits=cap).granted == 5
    now[0] += 300  # the want has lapsed
    t.release_many([Release(slot, "ok", TTL_MS, None, cap) for slot in held[5:]])
    assert t.acquire_many([f"b{i}" for i in range(5)], ttl_ms=TTL_MS, limits=cap, keep_free=1).granted == 4


def test_under_a_fleet_cap_a_gate_borrows_what_others_leave_unused_and_gives_way_to_their_share(
    redis_client: redis.Redis,
) -> None:
    """Two processes with a share of 5 under a fleet cap of 10: alone, one goes to its pool's 7;
    both busy, the one under its share gets all of it back (the borrower leaves a slot of the cap
    free), and the fleet never has more than 10 in flight."""
    gevent = pytest.importorskip("gevent")
    from workers.fleet.gate import Gate

    limits = ThrottleLimits(max_in_flight=10)
    a = Gate(FleetThrottle(redis_client), max_in_flight=5, borrow_up_to=7)
    b = Gate(FleetThrottle(redis_client), max_in_flight=5, borrow_up_to=7)
    in_flight = {"a": 0, "b": 0}
    peak = {"a": 0, "b": 0, "fleet": 0}

    def request(name: str, gate: Gate, hold_s: float) -> None:
        with gate.slot(ttl_ms=TTL_MS, limits=limits):
            in_flight[name] += 1
            peak[name] = max(peak[name], in_flight[name])
            peak["fleet"] = max(peak["fleet"], sum(in_flight.values()))
            gevent.sleep(hold_s)
            in_flight[name] -= 1

    gevent.joinall([gevent.spawn(request, "a", a, 0.05) for _ in range(30)], timeout=30, raise_error=True)
    assert (peak["a"], peak["fleet"], a.held) == (7, 7, 0)  # b left its share unused: a borrowed 2

    peak.update(a=0, b=0, fleet=0)
    busy_a = [gevent.spawn(request, "a", a, 0.05) for _ in range(300)]  # busy from before b to after it
    gevent.sleep(0.2)  # a is over its share when b's work arrives
    gevent.joinall([gevent.spawn(request, "b", b, 0.05) for _ in range(60)], timeout=60, raise_error=True)
    assert not all(job.dead for job in busy_a)  # a wanted slots the whole time b ran
    gevent.joinall(busy_a, timeout=60, raise_error=True)
    assert peak["fleet"] == 10 and peak["a"] <= 7
    assert peak["b"] == 5, peak  # b got its whole share back from the borrower


def test_a_gate_under_its_share_gets_back_the_slots_it_frees_before_any_borrower(redis_client: redis.Redis) -> None:
    """Another host's borrower asks the very moment after each of this gate's releases (before the
    gate's pump can ask again): while the gate still has requests to send, it finds nothing."""
    gevent = pytest.importorskip("gevent")
    from common.throttle import Release
    from workers.fleet.gate import Gate

    cap = ThrottleLimits(max_in_flight=10)
    borrower = FleetThrottle(redis_client)
    _fill(borrower, 5, prefix="other", limits=cap)  # another host at its share of 5
    started, grabbed_while_sending = [0], []

    class RacedByABorrower(FleetThrottle):
        def release_many(self, releases: Sequence[Release], *, wanting: bool = False) -> None:
            super().release_many(releases, wanting=wanting)
            slots = [f"borrowed{started[0]}-{i}" for i in range(5)]
            granted = borrower.acquire_many(slots, ttl_ms=TTL_MS, limits=cap, keep_free=1).granted
            borrower.release_many([Release(slot, "ok", TTL_MS, None, cap) for slot in slots[:granted]])
            if started[0] < 20:
                grabbed_while_sending.append(granted)

    gate = Gate(RacedByABorrower(redis_client), max_in_flight=5, borrow_up_to=5, batch_releases=True)

    def request() -> None:
        with gate.slot(ttl_ms=TTL_MS, limits=cap):
            started[0] += 1
            gevent.sleep(0.02)

    gevent.joinall([gevent.spawn(request) for _ in range(20)], timeout=30, raise_error=True)
    assert started[0] == 20 and grabbed_while_sending and not any(grabbed_while_sending), grabbed_while_sending


def test_a_gevent_gate_gives_the_slots_of_the_moment_back_in_one_call(redis_client: redis.Redis) -> None:
    gevent = pytest.importorskip("gevent")
    from common.throttle import Release
    from workers.fleet.gate import Gate

    class Counting(FleetThrottle):
        calls = 0

        def release_many(self, releases: Sequence[Release], *, wanting: bool = False) -> None:
            type(self).calls += 1
            super().release_many(releases, wanting=wanting)

    throttle = Counting(redis_client)
    gate = Gate(throttle, max_in_flight=50, batch_releases=True)

    def request() -> None:
        with gate.slot(ttl_ms=TTL_MS):
            gevent.sleep(0.01)

    gevent.joinall([gevent.spawn(request) for _ in range(200)], timeout=30, raise_error=True)
    gevent.sleep(0.05)  # the last release is on its way
    assert gate.held == 0 and throttle.snapshot().in_flight == 0 and throttle.snapshot().ok == 200
    assert Counting.calls <= 200 / 5  # answers that land together share a call


# --- telling congestion from a provider's background refusals (simulated fleets, real script) ----

MINUTE_MS = 60_000
SETTLED_MS = 20_000  # judged from here on: the first seconds are the fleet learning


def test_random_429s_that_do_not_follow_the_load_do_not_hold_the_fleet_back(redis_client: redis.Redis) -> None:
    """A provider refusing 10% of requests whatever the load (the chaos soak's faults): cutting
    the fleet would not lower that share, only the rows. The fleet keeps the rows of a fleet that
    ignores 429s (each request waits its own Retry-After), and learns the 10% as background, which
    fades with time so that a provider that recovers is watched closely again."""
    provider = Provider(random_429=0.10)
    adaptive = run_fleet(redis_client, provider, clients=100, duration_ms=MINUTE_MS)
    learned = FleetThrottle(redis_client, clock_ms=lambda: T0_MS + MINUTE_MS).snapshot().background_share
    faded = FleetThrottle(redis_client, clock_ms=lambda: T0_MS + MINUTE_MS + POLICY.background_half_life_ms
                          ).snapshot().background_share
    ignoring = run_fleet(redis_client, provider, clients=100, duration_ms=MINUTE_MS, adaptive=False)
    assert adaptive.rows >= 0.9 * ignoring.rows, (adaptive.rows, ignoring.rows)
    assert adaptive.paused_share(SETTLED_MS) < 0.05
    assert adaptive.unbounded_share(SETTLED_MS) > 0.8  # the first cut was undone (regrowing takes minutes at 15 s)
    assert 0.05 < learned <= POLICY.background_max
    assert faded == pytest.approx(learned / 2, rel=0.05)


def test_a_fleet_five_times_over_a_providers_capacity_holds_near_it_with_few_429s(
        redis_client: redis.Redis) -> None:
    provider = Provider(capacity=50)
    run = run_fleet(redis_client, provider, clients=250, duration_ms=MINUTE_MS)
    assert 0.85 * 50 <= run.mean_in_flight(SETTLED_MS) <= 50  # bench/throttle_run.py: -8% at 300
    assert run.share_429(SETTLED_MS) < 0.05
    assert run.background_share < 0.01  # every cut helped: nothing learned as background
    ignoring = run_fleet(redis_client, provider, clients=250, duration_ms=MINUTE_MS // 4, adaptive=False)
    assert ignoring.share_429(0) > 0.5  # what backing off together spares the provider


@pytest.mark.parametrize("balance_in_flight", [None, 10_000_000, 3_000], ids=["unknown", "known-large", "key-30usd"])
def test_a_known_balance_does_not_turn_a_429s_cut_into_a_collapse(redis_client: redis.Redis,
                                                                  balance_in_flight: int | None) -> None:
    """Issue 36: with the balance known, the first 429's cut made the one limit a balance rule that
    each answer drained by its cost (~0.21 of a worst case) and only 1/limit grew back: the fleet
    sank to 4-5 in flight for good. The capacity window and the balance bound are kept apart: the
    capacity is found as with the balance unknown, and the balance bound only shrinks by what the
    answers spent (here 0.21 x the rows, far from binding)."""
    run = run_fleet(redis_client, Provider(capacity=50), clients=250, duration_ms=MINUTE_MS,
                    start_in_flight=balance_in_flight, drain=0.21)
    assert 0.85 * 50 <= run.mean_in_flight(SETTLED_MS) <= 50, run.mean_in_flight(SETTLED_MS)
    assert run.share_429(SETTLED_MS) < 0.05
    snap = FleetThrottle(redis_client, clock_ms=lambda: T0_MS + MINUTE_MS).snapshot()
    assert snap.capacity_limit is not None and snap.capacity_limit >= 0.85 * 50
    if balance_in_flight is None:
        assert snap.balance_limit is None
    else:  # each answer took exactly its drain off the balance bound, nothing else did
        assert snap.balance_limit == pytest.approx(balance_in_flight - 0.21 * run.rows, abs=1.0)


def test_a_balance_that_binds_holds_the_fleet_under_it_while_the_capacity_stays_learned(
        redis_client: redis.Redis) -> None:
    """The other way round: a balance covering fewer worst cases than the provider serves holds the
    fleet there, shrinking as it is spent; the 429-free capacity window is not touched by it."""
    run = run_fleet(redis_client, Provider(capacity=50), clients=250, duration_ms=MINUTE_MS,
                    start_in_flight=40, drain=0.05)
    assert run.share_429(0) == 0  # never over the capacity
    snap = FleetThrottle(redis_client, clock_ms=lambda: T0_MS + MINUTE_MS).snapshot()
    assert snap.capacity_limit is None  # no 429: nothing learned, nothing cut
    assert snap.balance_limit is not None and snap.balance_limit < 40
    assert run.mean_in_flight(SETTLED_MS) <= 40


def test_over_capacity_with_random_429s_too_the_fleet_still_finds_the_capacity(redis_client: redis.Redis) -> None:
    run = run_fleet(redis_client, Provider(capacity=50, random_429=0.05), clients=250, duration_ms=MINUTE_MS)
    assert 0.8 * 50 <= run.mean_in_flight(SETTLED_MS) <= 50
    assert run.share_429(SETTLED_MS) < 0.15  # the 5% it cannot help, and a few over the capacity
