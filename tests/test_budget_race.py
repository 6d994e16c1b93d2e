"""The hard cap is never crossed: many threads race reserve/settle/fail/release/die on a small budget,
with redeliveries, reaped leases and slow workers whose answers land after the reap.

An observer checks the invariant on an atomic snapshot (MULTI) after every step of every thread;
at the end the fill is measured: the limit that ended the dataset is short by less than one
worst-case answer (dollars: plus what reaped requests gave back by landing after the stop).
"""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass

import msgpack
import pytest
import redis

from common.budget import Ask, Budget, BudgetSnapshot, open_run, parse_snapshot, queue_snapshot

WORST_TOKENS = 2_016
WORST_NUSD = 20_200_000
THREADS = 24
PROMPTS = 1_200


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    usd: float | None
    run_usd: float | None
    ends_by: str


CASES = [
    Case("tokens", 200_000, 5.0, None, "tokens"),
    Case("usd", 10_000_000, 1.5, None, "usd"),
    Case("run_usd", 10_000_000, 5.0, 1.2, "run_usd"),
]


def atomic_snapshot(client: redis.Redis, dataset: str) -> BudgetSnapshot:
    pipe = client.pipeline(transaction=True)
    queue_snapshot(pipe, dataset)
    return parse_snapshot(pipe.execute())


def check(s: BudgetSnapshot) -> None:
    assert s.kept_tokens <= s.limit and s.kept_tokens + s.reserved_tokens <= s.limit, s
    if s.limit_nusd:
        assert s.spent_nusd + s.held_nusd <= s.limit_nusd, s
    if s.run_limit_nusd:
        assert s.run_spent_nusd <= s.run_limit_nusd, s


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_many_racing_workers_never_cross_the_hard_cap(redis_client: redis.Redis, case: Case) -> None:
    open_run(redis_client, case.run_usd, ["race"])
    Budget(redis_client, "race").open(case.tokens, case.usd, "hard")
    deliveries: queue.Queue[str] = queue.Queue()
    ids = [f"p{i:04d}" for i in range(PROMPTS)]
    for pid in ids + random.Random(1).sample(ids, PROMPTS // 4):  # a quarter is delivered twice
        deliveries.put(pid)
    stop = threading.Event()
    errors: list[BaseException] = []
    billed_nusd = [0]  # every cost any thread passed to the budget
    # Dollars a reaped request gave back by landing after all (its worst case held as an orphan,
    # less its real cost): room that may appear only after the dataset stopped.
    late_room_nusd = [0]
    lock = threading.Lock()
    outcomes: dict[str, int] = {}

    def step_done() -> None:
        check(atomic_snapshot(redis_client, "race"))

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        budget = Budget(redis_client, "race")
        try:
            while not stop.is_set():
                try:
                    pid = deliveries.get(timeout=0.05)
                except queue.Empty:
                    return
                lease = uuid.uuid4().hex
                dying = rng.random() < 0.08
                ttl_ms = 30 if dying else 5_000
                ask = Ask(WORST_TOKENS, WORST_NUSD, WORST_TOKENS)
                r = budget.reserve(pid, lease, ttl_ms=ttl_ms, ask=ask)
                while r.status == "wait" and not stop.is_set():
                    time.sleep(rng.uniform(0.001, 0.01))
                    r = budget.reserve(pid, lease, ttl_ms=ttl_ms, ask=ask)
                step_done()
                if r.status == "busy":
                    deliveries.put(pid)  # Celery's retry: the same prompt, later
                    continue
                if r.status != "ok":
                    with lock:
                        outcomes[r.status] = outcomes.get(r.status, 0) + 1
                    continue
                tokens = rng.randint(1, WORST_TOKENS)
                cost = rng.randint(0, WORST_NUSD) / 1e9
                if dying:
                    # Stalls past its lease (reaped or taken over); half of them land afterwards.
                    time.sleep(0.06)
                    if rng.random() < 0.5:
                        continue
                if dying:
                    with lock:
                        late_room_nusd[0] += WORST_NUSD
                action = rng.random()
                if action < 0.75:
                    out = budget.settle(pid, lease, tokens, msgpack.packb({"id": pid}), cost_usd=cost)
                    # A live lease's answer within its worst case always fits: admission kept room.
                    assert dying or out != "discarded", "an admitted answer found no room"
                elif action < 0.85:
                    out = budget.fail(pid, lease, "token_mismatch", 1, "x", cost_usd=cost)
                elif action < 0.92:
                    cost = 0.0
                    out = budget.fail(pid, lease, "retries_exhausted", 3, "x")
                else:
                    budget.release(pid, lease, cost_usd=cost)
                    deliveries.put(pid)
                    out = "released"
                with lock:
                    billed_nusd[0] += round(cost * 1e9)
                    late_room_nusd[0] -= round(cost * 1e9) if dying else 0
                    outcomes[out] = outcomes.get(out, 0) + 1
                step_done()
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            stop.set()

    def reaper() -> None:
        budget = Budget(redis_client, "race")
        try:
            while not stop.is_set():
                budget.reap()
                step_done()
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    reaper_thread = threading.Thread(target=reaper)
    for t in [*threads, reaper_thread]:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    stop.set()
    reaper_thread.join()
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "workers still running after 120 s"

    time.sleep(0.05)
    Budget(redis_client, "race").reap()  # the last stalled leases
    s = atomic_snapshot(redis_client, "race")
    check(s)
    # Every cost passed in is in the count (none lost, none twice), and the kept rows match.
    assert s.spent_nusd == billed_nusd[0]
    assert redis_client.xlen(Budget(redis_client, "race").keys.results) == s.rows == outcomes.get("kept", 0)
    assert s.in_flight == 0
    assert s.ended_by == case.ends_by, (s, outcomes)
    assert outcomes.get("over", 0) > 0
    if case.ends_by == "tokens":
        assert s.limit - s.kept_tokens < WORST_TOKENS
        fill = s.kept_tokens / s.limit
    elif case.ends_by == "usd":
        # Orphans (reaped, never landed) stay held as possibly billed: they count as spent here.
        assert s.limit_nusd - s.spent_nusd - s.unresolved_nusd < WORST_NUSD + late_room_nusd[0]
        fill = s.spent_nusd / s.limit_nusd
    else:
        assert s.run_limit_nusd - s.run_spent_nusd - s.unresolved_nusd < WORST_NUSD + late_room_nusd[0]
        fill = s.run_spent_nusd / s.run_limit_nusd
    print(f"{case.name}: fill {100 * fill:.1f}% outcomes {outcomes} orphaned ${s.unresolved_nusd / 1e9:.4f} "
          f"late room ${late_room_nusd[0] / 1e9:.4f}")
