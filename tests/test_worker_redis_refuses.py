"""Redis refusing writes, the workers' side: a state they wait out, never a crash.

``maxmemory`` reached with ``noeviction`` (compose's setting) refuses every write that could grow
memory: budget scripts, kombu's unacked record, the dead-letter list. Before, a worker met it inside
kombu's read and died ("Unrecoverable error"), or threw away the paid answers whose settle Redis
refused. Real Valkey (AOF), two real gevent workers, the simulator, the real producer.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from common.stats import DatasetStats
from tests.chaos import RestartableValkey
from tests.fleet import Fleet, read_summary

pytestmark = pytest.mark.fleet

N = 600
REFUSE_S = 20



def _rows(client: redis.Redis) -> int:
    return int(client.scard("specfleet:ds:M:done"))


def test_maxmemory_reached_mid_run_is_waited_out_and_no_paid_answer_is_lost(
    chaos: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = chaos
    fleet.start_simulator("--latency-median-ms", "1500", "--latency-p99-ms", "3000")
    config = fleet.one_dataset("M", N)
    workers = {name: fleet.start_worker(name, concurrency=25) for name in ("w1", "w2")}
    client = redis.Redis.from_url(valkey.url, socket_timeout=10)
    producer = fleet.start_producer(config)
    deadline = time.monotonic() + 120
    while _rows(client) < 60:
        assert time.monotonic() < deadline and producer.poll() is None, fleet.all_logs()
        time.sleep(0.1)
    # Every write that could grow memory is refused from here: answers in flight land meanwhile.
    billed_before = fleet.sim_stats()["billed_requests"]
    client.config_set("maxmemory", "1")
    refused_at = time.monotonic()
    time.sleep(REFUSE_S)
    billed_while_refused = fleet.sim_stats()["billed_requests"] - billed_before
    client.config_set("maxmemory", "0")
    lines_at_resume = {name: fleet.log(name).count("\n") for name in workers}

    try:
        code = producer.wait(timeout=300)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run did not finish\n" + fleet.all_logs()) from None
    if code != 0:
        # The producer's side of a refusal is tested with the producer; if it stopped here, the
        # same command resumes, and what this test judges is what the workers kept meanwhile.
        print(f"the producer exited {code} during the refusal; resuming it")
        fleet.run_producer(config, name="resumed", timeout_s=300)

    for name, proc in workers.items():
        log = fleet.log(name)
        assert proc.poll() is None, f"worker {name} died\n{log[-8000:]}"
        assert "Unrecoverable error" not in log, log[-8000:]
        assert "Traceback" not in log, log[-8000:]
        # One line when Redis starts refusing, one when it takes writes again (per worker), not a
        # line per refused command: the few others are the spooled answers' own lines.
        assert log.count("Redis refuses writes") == 1, log[-8000:]
        assert log.count("Redis takes writes again after") == 1, log[-8000:]
        refused_lines = [ln for ln in log.splitlines() if "OutOfMemoryError" in ln or "command not allowed" in ln]
        assert len(refused_lines) <= 3, refused_lines[:20]
    assert time.monotonic() - refused_at > REFUSE_S

    fleet.assert_exactly_once(client, "M", N)
    summary = read_summary(fleet.out, "M")
    assert (summary["results"], summary["failed"]) == (N, 0), summary
    # Every answer the simulator billed ends counted: none thrown away while Redis refused its settle.
    sim = fleet.sim_stats()
    stats = DatasetStats(client, "M").read()
    assert stats.requests == sim["billed_requests"], (stats, sim)
    assert stats.billed_completion_tokens == sim["billed_completion_tokens"], (stats, sim)
    assert billed_while_refused > 0, "no answer landed while Redis refused writes: the test saw nothing"
    print(f"billed while refused: {billed_while_refused}, lines after resume: {lines_at_resume}")
