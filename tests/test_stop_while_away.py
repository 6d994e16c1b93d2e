"""A producer told to stop while Redis is unreachable exits within a bounded time (it cannot tell
Redis anything, and its rows on disk are durable already), with one line and its own exit code;
the same command, once Redis is back, completes with every prompt once."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from common.budget import Budget
from producer.execute import EXIT_STOPPED_REDIS_AWAY, STOP_WHILE_AWAY_S
from tests.chaos import RestartableValkey
from tests.fleet import Fleet, read_summary

pytestmark = pytest.mark.fleet

#: What the test allows on a busy box: the bound plus the time a hard exit takes.
BOUND_S = STOP_WHILE_AWAY_S + 10



def test_sigterm_while_redis_is_down_ends_the_producer_within_its_bound_and_the_rerun_completes(
    chaos: tuple[Fleet, RestartableValkey],
) -> None:
    fleet, valkey = chaos
    n = 300
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("S", n)
    fleet.start_worker("w1", concurrency=20)
    producer = fleet.start_producer(config)
    client = redis.Redis.from_url(valkey.url, socket_timeout=10)
    deadline = time.monotonic() + 120
    while Budget(client, "S").snapshot().rows < 40:
        assert time.monotonic() < deadline and producer.poll() is None, fleet.all_logs()
        time.sleep(0.1)
    valkey.kill()
    time.sleep(1)  # the producer meets the outage
    producer.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    try:
        producer.wait(timeout=BOUND_S + 60)
    except Exception:
        producer.kill()
        raise AssertionError(f"the producer was still running {BOUND_S + 60:.0f} s after SIGTERM") from None
    gone_s = time.monotonic() - signalled
    text = fleet.log("producer")
    assert gone_s < BOUND_S, f"{gone_s:.1f} s after SIGTERM\n{text}"
    assert producer.returncode == EXIT_STOPPED_REDIS_AWAY, text
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("specfleet:")]
    assert len(lines) == 1 and "while Redis at" in lines[0] and "run the same command again" in lines[0], text
    print(f"producer gone {gone_s:.1f} s after SIGTERM with Redis down")

    valkey.start()
    fleet.run_producer(config, name="rerun", timeout_s=240)
    fleet.assert_exactly_once(client, "S", n)
    summary = read_summary(fleet.out, "S")
    assert summary["results"] == n and summary["failed"] == 0, summary
