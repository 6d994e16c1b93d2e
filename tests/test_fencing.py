"""A producer paused past its lock's TTL while another producer takes over: fenced writes.

Producer A runs; SIGSTOP holds it until its lock expires; producer B starts on the same config and
output folder and writes rows; A resumes (after B has finished, or while B still runs). A must stop
with its one line and write nothing; every prompt's row is on disk exactly once, the checkpoint
counts the lines on disk, no line is torn. A rerun over a folder that lost rows (what a stale writer
did before fencing) asks those prompts again instead of saying "all done" over fewer rows.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from common.budget import Budget
from producer.execute import EXIT_FENCED
from tests.fleet import Fleet, read_rows, read_summary

pytestmark = pytest.mark.fleet

DATASET = "F"
LOCK = "specfleet:producer:lock"


def _checkpoint(fleet: Fleet) -> dict[str, Any]:
    path = fleet.out / DATASET / ".checkpoint.json"
    return json.loads(path.read_text()) if path.exists() else {"rows": 0, "generation": 0}



def _folder_digest(fleet: Fleet) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((fleet.out / DATASET).glob("*")) if p.name != ".lock"}


def assert_disk_whole(fleet: Fleet, n: int) -> None:
    """Every prompt once, the checkpoint counting the lines, no torn line."""
    lines = 0
    for shard in sorted((fleet.out / DATASET).glob("shard-*.jsonl")):
        data = shard.read_bytes()
        assert not data or data.endswith(b"\n"), f"{shard.name}: torn last line"
        for line in data.split(b"\n")[:-1]:
            json.loads(line)  # a torn or spliced line does not parse
            lines += 1
    ids = Counter(r["id"] for r in read_rows(fleet.out, DATASET))
    twice = sorted(i for i, c in ids.items() if c > 1)
    missing = n - len(ids)
    assert not twice and not missing, f"{missing} prompts missing from disk, {len(twice)} twice: {twice[:5]}"
    assert _checkpoint(fleet)["rows"] == lines == n


def disk_report(fleet: Fleet, n: int) -> str:
    ids = Counter(r["id"] for r in read_rows(fleet.out, DATASET))
    lines = sum(s.read_bytes().count(b"\n") for s in (fleet.out / DATASET).glob("shard-*.jsonl"))
    return (f"{n - len(ids)} of {n} prompts missing, {sum(1 for c in ids.values() if c > 1)} twice, "
            f"checkpoint rows {_checkpoint(fleet)['rows']} over {lines} lines")


def _stopped_line(fleet: Fleet, name: str) -> str:
    text = fleet.log(name)
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("specfleet:")]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("b_done_first", [True, False], ids=["B-exited", "B-running"])
def test_a_producer_paused_past_its_lock_writes_nothing_once_another_took_over(
    fleet: Fleet, redis_client: redis.Redis, b_done_first: bool
) -> None:
    n = 500
    fleet.start_simulator("--latency-median-ms", "350")
    config = fleet.one_dataset(DATASET, n)
    fleet.start_worker("w1", concurrency=8)
    a = fleet.start_producer(config, "A")
    fleet.wait_for(lambda: int(_checkpoint(fleet)["rows"]) >= 30, 120, "A's first rows on disk")
    a.send_signal(signal.SIGSTOP)
    try:
        a_rows = int(_checkpoint(fleet)["rows"])
        fleet.wait_for(lambda: not redis_client.exists(LOCK), 30, "A's lock to expire")
        b = fleet.start_producer(config, "B")
        # B has taken the lock and written rows of its own past A's checkpoint.
        fleet.wait_for(lambda: int(_checkpoint(fleet)["rows"]) > a_rows + 20, 120, "B's rows on disk")
        if b_done_first:
            assert b.wait(timeout=180) == 0, fleet.all_logs()
            before = _folder_digest(fleet)
        else:
            assert b.poll() is None and Budget(redis_client, DATASET).snapshot().rows < n, \
                "B must still be running when A resumes: make the run longer"
    finally:
        a.send_signal(signal.SIGCONT)
    try:
        a.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("A did not stop after it resumed\n" + fleet.all_logs()) from None
    if not b_done_first:
        b.wait(timeout=180)
    print(f"A resumed: exit {a.returncode}; on disk: {disk_report(fleet, n)}")
    assert a.returncode == EXIT_FENCED, f"A exit {a.returncode}\n{fleet.all_logs()}"
    line = _stopped_line(fleet, "A")
    assert "another producer" in line and "generation" in line, line
    if b_done_first:
        assert _folder_digest(fleet) == before, "A wrote to the output folder after it lost the lock"
    else:
        assert b.returncode == 0, fleet.all_logs()
    assert_disk_whole(fleet, n)
    fleet.assert_exactly_once(redis_client, DATASET, n)
    # Nothing was asked twice: no worker was killed, and the stale producer queued nothing.
    asked = fleet.sim_stats()["requests"]
    assert asked == n, asked

    fleet.run_producer(config, name="rerun")
    assert_disk_whole(fleet, n)
    summary = read_summary(fleet.out, DATASET)
    assert summary["results"] == n and summary["results_this_run"] == 0, summary
    assert fleet.sim_stats()["requests"] == asked


def _drop_last_rows(folder: Path, k: int) -> list[str]:
    """What a stale producer's write did to the folder before fencing: the last k rows gone, the
    checkpoint at the shorter folder (as it was written). Returns the ids removed."""
    cp = json.loads((folder / ".checkpoint.json").read_text())
    shards = sorted(folder.glob("shard-*.jsonl"))
    lines = [(s, ln) for s in shards for ln in s.read_bytes().split(b"\n")[:-1]]
    keep, gone = lines[:-k], lines[-k:]
    for s in shards:
        s.write_bytes(b"".join(ln + b"\n" for sh, ln in keep if sh == s))
    last = shards[-1] if any(sh == shards[-1] for sh, _ in keep) else shards[-2]
    for s in shards:
        if s != last and s.stat().st_size == 0 and s.name > last.name:
            s.unlink()
    cp.update(rows=len(keep), shard=int(last.stem.split("-")[1]), offset=last.stat().st_size,
              rows_in_shard=sum(1 for sh, _ in keep if sh == last))
    (folder / ".checkpoint.json").write_text(json.dumps(cp))
    return [json.loads(ln)["id"] for _, ln in gone]


def test_a_rerun_asks_again_for_rows_redis_counts_but_the_folder_lost(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    n = 120
    fleet.start_simulator("--latency-median-ms", "20")
    config = fleet.one_dataset(DATASET, n)
    fleet.start_worker("w1", concurrency=20)
    fleet.run_producer(config)
    assert_disk_whole(fleet, n)
    gone = _drop_last_rows(fleet.out / DATASET, 37)
    asked = fleet.sim_stats()["requests"]

    out = fleet.run_producer(config, name="rerun")
    print(f"after the rerun: {disk_report(fleet, n)}; asked again {fleet.sim_stats()['requests'] - asked}")
    assert_disk_whole(fleet, n)
    assert "37 kept rows the shards do not hold" in out, out
    fleet.assert_exactly_once(redis_client, DATASET, n)
    summary = read_summary(fleet.out, DATASET)
    assert summary["results"] == n and summary["results_this_run"] == 37, summary
    again = fleet.sim_stats()["requests"] - asked
    assert again == 37, f"{again} prompts asked again, expected the 37 lost ones ({gone[:3]}…)"
