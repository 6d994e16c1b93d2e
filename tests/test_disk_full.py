"""The output folder refusing writes (full disk, read-only, a file size limit) stops the producer
with one clear line; the rows wait in Redis and the same command, run again, writes them once."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import time

import pytest
import redis

from tests.fleet import Fleet

pytestmark = pytest.mark.fleet

#: Enough for the first rows of the first shard, far below the run's output (~300 rows of a few kB).
FSIZE_LIMIT_BYTES = 64 * 1024


def _limit_file_size() -> None:
    # Ignored, SIGXFSZ no longer kills the process: write() fails with EFBIG as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT_BYTES, FSIZE_LIMIT_BYTES))


def test_a_folder_that_refuses_writes_stops_cleanly_and_the_rerun_writes_each_row_once(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    n = 300
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("F", n)

    log_path, err_path = fleet.logs / "limited.log", fleet.logs / "limited.err"
    with log_path.open("wb") as log, err_path.open("wb") as err:
        proc = subprocess.Popen(fleet.producer_cmd(config), env=fleet.env(), stdout=log, stderr=err,
                                preexec_fn=_limit_file_size)
    try:
        # Paused once everything is queued and its plan has let requests start, the producer finds all
        # rows waiting in the stream when it resumes: its collector then reads them in big batches,
        # the way a busy run does.
        deadline = time.monotonic() + 60
        while redis_client.llen("specfleet.q.F") < n or "requests start" not in err_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, fleet.all_logs()
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        fleet.start_worker("w1", concurrency=30)
        fleet.wait_rows(redis_client, "F", n, timeout_s=120)
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err_path.read_text()
    assert proc.returncode != 0, fleet.all_logs()
    assert "Traceback" not in stderr + log_path.read_text(), stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("specfleet: ") and "File too large" in last and "shard-00000.jsonl" in last, stderr

    # Every kept row that did not reach the disk is still in the results stream.
    path = fleet.out / "F" / ".checkpoint.json"
    checkpoint = json.loads(path.read_text()) if path.exists() else {"rows": 0, "last_id": "0-0", "shard": 0,
                                                                      "offset": 0}
    # And no torn line waits for the rerun: the failed write was cut back to the last durable offset
    # at once, so a reader of the folder meanwhile reads whole rows only.
    for shard in sorted((fleet.out / "F").glob("shard-*.jsonl")):
        data = shard.read_bytes()
        assert not data or data.endswith(b"\n"), f"{shard.name}: torn last line ({len(data):,} bytes)"
        assert all(json.loads(line) for line in data.splitlines())
    open_shard = fleet.out / "F" / f"shard-{checkpoint['shard']:05d}.jsonl"
    assert (open_shard.stat().st_size if open_shard.exists() else 0) == checkpoint["offset"]
    assert checkpoint["rows"] < n, "the limit must have hit before the run's rows were all on disk"
    waiting = redis_client.xrange("specfleet:ds:F:results", min="(" + checkpoint["last_id"])
    assert len(waiting) == n - checkpoint["rows"]

    asked = fleet.sim_stats()["requests"]
    fleet.run_producer(config, name="resumed")
    fleet.assert_exactly_once(redis_client, "F", n)
    assert fleet.sim_stats()["requests"] == asked, "the resumed run asked again for rows that were waiting"
    assert redis_client.xlen("specfleet:ds:F:results") <= 1, "rows on disk are trimmed from Redis"
