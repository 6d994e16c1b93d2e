"""A worker started while Redis refuses writes waits, then works; it never dies of it.

kombu binds the worker's queues when its consumer starts (``SADD _kombu.binding.specfleet.idle``).
Before workers/fleet/consumer.py, a Redis past ``maxmemory`` (noeviction) refused that write and the
worker exited 1 ("Unrecoverable error: OutOfMemoryError"). Real Valkey, a real gevent worker, the
simulator, the real producer.
"""

from __future__ import annotations

import time

import pytest
import redis

from tests.chaos import RestartableValkey
from tests.fleet import Fleet

pytestmark = pytest.mark.fleet

N = 40
#: How long the worker is left facing the refusal before Redis takes writes again.
REFUSED_S = 8



def test_a_worker_started_while_redis_refuses_writes_waits_then_works(
    chaos: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = chaos
    client = redis.Redis.from_url(valkey.url, socket_timeout=10)
    fleet.start_simulator("--latency-median-ms", "200")
    producer = fleet.start_producer(fleet.one_dataset("R", N))
    deadline = time.monotonic() + 90
    while not client.hget("specfleet:active", "specfleet.q.R"):  # the run started: its writes are done
        assert time.monotonic() < deadline and producer.poll() is None, fleet.all_logs()
        time.sleep(0.2)
    client.config_set("maxmemory", 1)
    try:
        worker = fleet.start_worker("w1", concurrency=10)
        deadline = time.monotonic() + 90
        while "Redis refuses writes" not in fleet.log("w1"):
            assert time.monotonic() < deadline and worker.poll() is None, fleet.log("w1")[-6000:]
            time.sleep(0.2)
        time.sleep(REFUSED_S)
        log = fleet.log("w1")
        assert worker.poll() is None, log[-6000:]
        assert "Unrecoverable error" not in log, log[-6000:]
        assert log.count("Redis refuses writes") == 1, log[-6000:]
        assert int(client.scard("specfleet:ds:R:done")) == 0
    finally:
        client.config_set("maxmemory", 0)
    fleet.wait_ready("w1")
    assert producer.wait(timeout=180) == 0, fleet.all_logs()
    fleet.assert_exactly_once(client, "R", N)
    assert "Redis takes writes again" in fleet.log("w1"), fleet.log("w1")[-6000:]
    assert worker.poll() is None, fleet.log("w1")[-6000:]
