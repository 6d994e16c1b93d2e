"""Stopping workers while Redis is down, and a worker meeting a different Redis.

Before: workers SIGTERMed 8 s after Redis went away were alive 8-20 minutes later ("Redis
unreachable for 300 s"), and leftovers reconnected to a new Redis on the same port and worked the
next run's prompts. Real Valkey (AOF, SIGKILLed and started again on its port), real gevent
workers, the simulator, the real producer.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import redis
import requests

from common.stats import DatasetStats
from tests.chaos import RestartableValkey
from tests.fleet import Fleet, read_summary
from workers.fleet.stop import STOP_BOUND_S

pytestmark = pytest.mark.fleet

#: A loaded box runs late; the bound itself is what the worker enforces.
SLACK_S = 15
N = 1500




def _generations(fleet: Fleet) -> list[dict[str, Any]]:
    """Every answer the simulator billed so far: its prompt, and whether its client was gone."""
    return list(requests.get(fleet.sim_url + "/_sim/stats?detail=1", timeout=30).json()["generations"])


def test_sigterm_with_redis_down_ends_workers_within_the_bound_and_their_spool_replays(
    chaos: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = chaos
    spool = fleet.tmp / "spool"
    # Short latencies: at the kill many tasks are in their first Redis calls, which hold their
    # connections while they retry, and answers land before the SIGTERM (their settles already
    # waiting for Redis) and after it.
    fleet.start_simulator("--latency-median-ms", "1000", "--latency-p99-ms", "3000")
    config = fleet.one_dataset("D", N)
    workers = {name: fleet.start_worker(name, concurrency=100) for name in ("w1", "w2")}
    producer = fleet.start_producer(config)
    client = redis.Redis.from_url(valkey.url, socket_timeout=10)
    fleet.wait_for(lambda: int(client.scard("specfleet:ds:D:done")) >= 300, 120, "rows before the kill")
    fleet.wait_for(lambda: fleet.sim_stats()["in_flight"] >= 100, 30, "requests in flight")
    valkey.kill()
    time.sleep(2)  # as make soak does: the workers have met the outage when they are told to stop
    stopped = time.monotonic()
    for proc in workers.values():
        proc.send_signal(signal.SIGTERM)
    took = {}
    for name, proc in workers.items():
        left_s = STOP_BOUND_S + SLACK_S - (time.monotonic() - stopped)
        try:
            proc.wait(timeout=max(0.1, left_s))
        except Exception:
            raise AssertionError(f"{name} still running {STOP_BOUND_S + SLACK_S} s after SIGTERM with Redis "
                                 f"down\n{fleet.log(name)[-6000:]}") from None
        took[name] = round(time.monotonic() - stopped, 1)
    print(f"workers exited {took} s after SIGTERM (bound {STOP_BOUND_S} s)")
    for name in workers:
        log = fleet.log(name)
        # Acks Redis could not take are kept for later, not a CRITICAL line and a traceback per task.
        assert "Couldn't ack" not in log, log[-6000:]
        # The one traceback left is gevent's report of Celery's remote-control greenlet, which dies
        # with its connection when Redis goes (Celery's own; it comes back with the consumer).
        reports = (log.count("Traceback") - log.count("During handling of the above exception")
                   - log.count("The above exception was the direct cause"))
        assert reports <= log.count("celery/worker/pidbox.py"), log[-6000:]
    # What they had paid for is on disk: each answer in flight at the kill, settled or spooled.
    spooled = len(list(spool.glob("*.spool")))
    billed = fleet.sim_stats()["billed_requests"]
    exited_s = time.time()
    answered = {g["prompt_hash"] for g in _generations(fleet) if not g["abandoned"]}
    assert spooled > 0, fleet.all_logs()
    print(f"{spooled} answers spooled, {billed} billed when both had stopped")

    valkey.start()
    fleet.start_worker("w3", concurrency=15)
    fleet.wait_for(lambda: not list(spool.glob("*.spool")), 60, "the spool to be replayed by the next worker")
    assert fleet.log("w3").count("replayed from the spool") == spooled, fleet.log("w3")[-6000:]
    assert producer.wait(timeout=240) == 0, fleet.all_logs()
    fleet.assert_exactly_once(client, "D", N)
    # Every answer the stopped workers received was kept or spooled: none of those prompts was
    # asked again (before: 'N settle(s) not yet spooled … are left', asked again by w3).
    asked_again = answered & {r["prompt"] for r in fleet.sim_requests() if r["start_s"] > exited_s}
    print(f"{len(answered)} answers received by the stopped workers, {len(asked_again)} asked again")
    assert not asked_again, f"{len(asked_again)} of {len(answered)} paid answers left unspooled\n{fleet.all_logs()}"
    assert read_summary(fleet.out, "D")["failed"] == 0
    # No answer paid before the stop was thrown away: every billed answer is counted.
    sim = fleet.sim_stats()
    stats = DatasetStats(client, "D").read()
    assert stats.requests == sim["billed_requests"] >= billed, (stats, sim)


def test_a_worker_that_meets_a_different_redis_on_its_url_says_so_and_leaves(
    chaos: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = chaos
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("A", 60)
    worker = fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config, name="run1")
    valkey.kill()
    # Another Redis on the same port: another data dir, another run.
    other = RestartableValkey(fleet.tmp / "other-valkey", port=valkey.port)
    other.start()
    try:
        fleet.out = fleet.tmp / "out2"
        config2 = fleet.one_dataset("B", 30)
        second = fleet.start_producer(config2, "run2")
        fleet.wait_for(lambda: worker.poll() is not None, 60, "the worker to leave")
        log = fleet.log("w1")
        lines = [ln for ln in log.splitlines() if "a different Redis" in ln]
        assert len(lines) == 1, log[-6000:]
        # It worked none of the new run's prompts: a worker started for that run does.
        assert "B/b" not in fleet.log("w1"), log[-6000:]
        fleet.start_worker("w2", concurrency=10)
        assert second.wait(timeout=120) == 0, fleet.all_logs()
        fleet.assert_exactly_once(redis.Redis.from_url(other.url), "B", 30)
    finally:
        other.stop()
