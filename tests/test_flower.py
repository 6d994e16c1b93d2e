"""What a Flower user sees while task events travel in batches (workers/fleet/events.py)."""

from __future__ import annotations

import sys
import time

import pytest
import redis
import requests

from tests.fleet import Fleet, free_port

pytestmark = pytest.mark.fleet


def _start_flower(fleet: Fleet) -> str:
    port = free_port()
    fleet._spawn("flower", [sys.executable, "-m", "celery", "-A", "workers", "flower", f"--port={port}",
                            "--address=127.0.0.1"], fleet.env(FLOWER_UNAUTHENTICATED_API="true"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(url + "/healthcheck", timeout=1).text == "OK":
                return url
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, fleet.log("flower")
        time.sleep(0.2)


def test_flower_shows_every_task_outcome_and_every_worker(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "100")
    flower = _start_flower(fleet)
    for name in ("fa", "fb"):
        fleet.start_worker(name, concurrency=20)
    for name in ("fa", "fb"):  # both consuming before the run: a run's first requests need not wait for the plan
        fleet.wait_ready(name)
    config = fleet.one_dataset("F", 60)
    fleet.run_producer(config)
    rows = fleet.assert_exactly_once(redis_client, "F", 60)
    deadline = time.monotonic() + 10  # events are batched: at most a flush interval behind
    while True:
        tasks = requests.get(flower + "/api/tasks", timeout=10).json()
        done = {t["uuid"]: t for t in tasks.values() if t.get("state") == "SUCCESS"}
        if len(done) >= len(rows) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert len(done) == 60, f"Flower saw {len(done)} of 60 tasks succeed: {list(tasks.values())[:3]}"
    assert {t["result"] for t in done.values()} == {"'kept'"}
    # Each task went through every state Flower shows, with a runtime.
    assert all(t["received"] and t["started"] and t["runtime"] is not None for t in done.values())
    assert {t["worker"].split("@")[0] for t in done.values()} == {"fa", "fb"}
    workers = requests.get(flower + "/api/workers", params={"refresh": 1}, timeout=30).json()
    assert {w.split("@")[0] for w in workers} == {"fa", "fb"}
