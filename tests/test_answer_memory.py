"""A worker's memory for answers in flight is bounded by what the user sets.

Real processes: the simulator serves answers of 300,000 characters (~200,000 tokens, ~337 KB of
JSON), eight at once to one gevent worker. Each costs ~60 MB while it becomes a row (the
tokenizer's encoding of it, mostly: workers/fleet/answer_room.py); rebuilt side by side, eight took the
worker 400 MB over its baseline. With ``SPECFLEET_ANSWER_BYTES_IN_FLIGHT`` at 400 KB they are
turned into rows one at a time, and the worker's peak (VmHWM of the real process, reset after a
warm-up run) stays within the documented bound. Answers over ``SPECFLEET_MAX_ANSWER_BYTES`` fail
``answer_too_large``, billed and counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from tests.fleet import Fleet, prompts, read_summary, write_jsonl

N_BIG = 8
IN_FLIGHT_BYTES = 400_000
MAX_ANSWER_BYTES = 370_000
#: Memory per answer byte while it becomes a row (measured: ~60 MB for a 337 KB answer, demo
#: tokenizer): README.md's bound for SPECFLEET_ANSWER_BYTES_IN_FLIGHT.
ROW_FACTOR = 180
#: What the bound leaves out: the bodies and parsed answers of the others, waiting (~1.5 MB each),
#: and allocator slack.
SLACK_BYTES = 40 << 20


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _config(fleet: Fleet, name: str, rows: list[Any], length: str) -> Path:
    data = write_jsonl(fleet.tmp / f"{name}.jsonl", rows)
    config = fleet.write_config([{"name": name, "path": data, "length": length, "budget_tokens": 100_000_000}],
                                timeout_s=60, max_attempts=2)
    # Room for 200,000-token answers (the simulator's context is 262,144).
    text = config.read_text().replace("max_tokens = 1024", "max_tokens = 230000")
    config.write_text(text.replace("max_tokens = 4096", "max_tokens = 250000"))
    return config


def test_answers_in_flight_stay_within_the_workers_bound(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "200", "--latency-p99-ms", "400")
    # "short" (max_tokens 230,000): ~300,000 characters; "long" (250,000): ~360,000, over the cap.
    fleet.sim_config(length_classes={
        "short": {"min_max_tokens": 0, "reasoning_mean": 100_000, "reasoning_sd": 1,
                  "content_mean": 100_000, "content_sd": 1},
        "long": {"min_max_tokens": 240_000, "reasoning_mean": 120_000, "reasoning_sd": 1,
                 "content_mean": 120_000, "content_sd": 1},
    })
    worker = fleet.start_worker("w1", concurrency=N_BIG, SPECFLEET_ANSWER_BYTES_IN_FLIGHT=str(IN_FLIGHT_BYTES),
                                SPECFLEET_MAX_ANSWER_BYTES=str(MAX_ANSWER_BYTES))
    fleet.wait_ready("w1")
    # Warm-up: small answers load the tokenizer and every code path; the peak is measured after it.
    warm = prompts(N_BIG, "w")
    for r in warm:
        r["messages"][0]["content"] = '#sim {"reasoning": "r", "content": "c"} ' + r["messages"][0]["content"]
    fleet.run_producer(_config(fleet, "W", warm, "short"), name="producer-warm")
    baseline_kb = _status_kb(worker.pid, "VmRSS")
    Path(f"/proc/{worker.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    fleet.run_producer(_config(fleet, "B", prompts(N_BIG, "b"), "short"), name="producer-big", timeout_s=300)
    peak_kb = _status_kb(worker.pid, "VmHWM")
    grown = (peak_kb - baseline_kb) * 1024
    bound = ROW_FACTOR * IN_FLIGHT_BYTES + SLACK_BYTES
    rows = fleet.assert_exactly_once(redis_client, "B", N_BIG)
    sizes = [len(r["conversations"][-1]["content"] or "") + len(r["conversations"][-1].get("reasoning_content") or "")
             for r in rows]
    print(f"{N_BIG} answers of {min(sizes):,}-{max(sizes):,} characters: worker baseline {baseline_kb / 1024:.0f} MB, "
          f"peak +{grown / 2**20:.0f} MB (bound {bound / 2**20:.0f} MB)")
    assert min(sizes) > 250_000, "the answers are as large as the test means them to be"
    assert grown <= bound, f"peak {grown / 2**20:.0f} MB over the baseline, bound {bound / 2**20:.0f} MB"
    assert "waits for room" in fleet.log("w1")

    # Over the per-answer cap: read and dropped, the prompt failed with its cost counted.
    before = fleet.sim_stats()
    fleet.run_producer(_config(fleet, "L", prompts(3, "l"), "long"), name="producer-large")
    after = fleet.sim_stats()
    failed = [json.loads(x) for x in (fleet.out / "L" / "failed.jsonl").read_text().splitlines()]
    assert len(failed) == 3 and all(f["reason"] == "answer_too_large" and f["attempts"] == 1 for f in failed), failed
    assert all("SPECFLEET_MAX_ANSWER_BYTES" in f["detail"] for f in failed)
    summary = read_summary(fleet.out, "L")
    billed = after["billed_cost_usd"] - before["billed_cost_usd"]
    assert after["billed_requests"] - before["billed_requests"] == 3 == summary["requests"]
    assert abs(summary["spent_usd"] - billed) < 1e-6, (summary["spent_usd"], billed)
    assert summary["failures"] == {"answer_too_large": 3}
