"""What a Flower user sees while task events travel in batches (workers/fleet/events.py)."""

from __future__ import annotations

import sys
import time

import pytest
import redis
import requests

from tests.fleet import Fleet, free_port

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


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


BATCH_REQUEST = "\n".join(['temperature = 1.0', 'mode = "batch"', "batch_size = 30", "batch_gather_s = 1.0",
                           "batch_poll_s = 1.0"])


@pytest.mark.long
def test_open_batches_show_in_flower_celery_inspect_and_the_run_progress(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """A batch-mode run with its batches in_progress for 25 s: Flower's /api/workers (each worker's
    stats) and its worker page, ``celery inspect open_batches`` and ``specfleet run``'s plain
    progress lines name every open batch with its requests, age and state."""
    import subprocess

    from common.batches import open_batches

    fleet.start_simulator("--latency-median-ms", "20", "--batch-validate-s", "0.5", "--batch-run-s", "25",
                          "--batch-finalize-s", "0.2")
    flower = _start_flower(fleet)
    fleet.start_worker("w1", concurrency=80)
    fleet.wait_ready("w1")
    config = fleet.one_dataset("M", 60, request=BATCH_REQUEST)
    # The run's own progress (plain lines: its stderr is no terminal), not the harness' --no-progress.
    producer = fleet._spawn("producer", [sys.executable, "-m", "producer.cli", "run", str(config), "--stall-s", "5",
                                         "--yes"], fleet.env())

    def submitted() -> list[dict[str, object]]:
        batches = open_batches(redis_client)
        polled = [b for b in batches if b["status"] == "in_progress"]
        return batches if sum(int(b["requests"]) for b in polled) == 60 else []

    fleet.wait_for(submitted, 120, "every prompt in a batch in_progress")
    mine = {str(b["batch_id"]): b for b in submitted()}
    workers = requests.get(flower + "/api/workers", params={"refresh": 1}, timeout=30).json()
    name = next(w for w in workers if w.startswith("w1@"))
    stats = workers[name]["stats"]
    shown = {b["batch_id"]: b for b in stats["open_batch_list"]}
    assert shown.keys() == mine.keys(), (stats.get("open_batches"), mine)
    for batch_id, b in shown.items():
        assert b["requests"] == mine[batch_id]["requests"] and b["dataset"] == "M"
        assert b["state"] == "in_progress", b
        assert mine[batch_id]["age_s"] <= b["age_s"] < float(mine[batch_id]["age_s"]) + 30, (b, mine[batch_id])
    assert stats["open_batches"].startswith(f"{len(mine)} open, 60 requests, oldest "), stats["open_batches"]
    # The worker page renders the stats Flower does not know in its "Other" tab.
    page = requests.get(f"{flower}/worker/{name}", timeout=30).text
    assert "open_batch_list" in page and all(batch_id in page for batch_id in mine), page[-3000:]
    inspect = subprocess.run([sys.executable, "-m", "celery", "-A", "workers", "inspect", "open_batches", "--json",
                              "-d", name], env=fleet.env(), capture_output=True, text=True, timeout=60)
    assert all(batch_id in inspect.stdout for batch_id in mine), inspect.stdout + inspect.stderr
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "M", 60)
    lines = [line for line in fleet.log("producer").splitlines() if " batches open=" in line]
    assert any(f"open={len(mine)} requests=60 " in line and "states=in_progress:" in line for line in lines), \
        fleet.log("producer")[-3000:]
