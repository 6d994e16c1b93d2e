"""A request leaves only while its prompt's lease outlives the whole attempt, even after a Redis
outage longer than the lease.

The soak's case, with real processes: a renewal waiting out the outage is applied when Redis comes
back, but dated by the worker's clock when it was *made*, so the lease it "extends" has already
lapsed. Sent on that lease, the attempt was open while the prompt's redelivery (the visibility
timeout passed during the outage) found the lease free, reserved it and asked again.

Here every prompt's first attempt meets a 429 with Retry-After 8 s, so each worker renews its
lease after 8 s; Redis is SIGSTOPped before those renewals and stays stopped longer than the lease
(17.7 s at timeout_s 6, backoff_max_s 0.5, as in the soak). Answers take 2.5 s, longer than a
redelivery takes to reserve and send. The simulator's request log says whether two requests of one
prompt were open at once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from typing import Any

import pytest
import redis

from tests.fleet import Fleet, prompts, read_rows, write_jsonl

N_PROMPTS = 6
TIMEOUT_S = 6.0
RETRY_AFTER_S = 8.0
LATENCY_MS = 2500
#: Longer than the lease (timeout_s × 1.2 + backoff_max_s + 10 s = 17.7 s) and than the renewals'
#: wait, so every renewal made during the outage dates a lease that lapsed before Redis returns.
OUTAGE_S = 30.0


def _overlaps(records: list[dict[str, Any]]) -> list[tuple[str, tuple[float, float]]]:
    """Requests that started while an earlier request of the same prompt was still open."""
    by_prompt: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        by_prompt[r["prompt"]].append((r["start_s"], r["end_s"]))
    found = []
    for prompt, spans in by_prompt.items():
        spans.sort()
        for i, span in enumerate(spans[1:], 1):
            if span[0] < max(end for _, end in spans[:i]):
                found.append((prompt, span))
    return found


def test_no_request_goes_out_on_a_lease_that_lapsed_during_a_redis_outage(
    fleet: Fleet, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The outage outlasts the visibility timeout: each prompt's message is delivered again after it.
    short = {"SPECFLEET_VISIBILITY_TIMEOUT_S": "10", "SPECFLEET_UNACKED_RESTORE_S": "1"}
    env = fleet.env
    monkeypatch.setattr(fleet, "env", lambda **extra: env(**{**short, **extra}))
    fleet.start_simulator("--latency-median-ms", "20")
    rows: list[Any] = prompts(N_PROMPTS, "l")
    script = {"fail_attempts": [429], "retry_after_s": RETRY_AFTER_S, "latency_ms": LATENCY_MS}
    for i, r in enumerate(rows):
        r["messages"][0]["content"] = f"#sim {json.dumps(script)} case-{i}"
    data = write_jsonl(fleet.tmp / "l.jsonl", rows)
    config = fleet.write_config([{"name": "L", "path": data, "length": "short", "budget_tokens": 10_000_000}],
                                timeout_s=TIMEOUT_S)
    # Free greenlets for the redeliveries, while the first deliveries still hold theirs.
    fleet.start_worker("w1", concurrency=10)
    fleet.start_worker("w2", concurrency=10)
    producer = fleet.start_producer(config)

    # Every prompt answered its 429: each worker now waits out the Retry-After before renewing.
    deadline = time.monotonic() + 120
    while len({r["prompt"] for r in fleet.sim_requests() if r["status"] == 429}) < N_PROMPTS:
        assert time.monotonic() < deadline and producer.poll() is None, fleet.all_logs()
        time.sleep(0.1)
    redis_pid = int(redis_client.info("server")["process_id"])
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        time.sleep(OUTAGE_S)
    finally:
        os.kill(redis_pid, signal.SIGCONT)

    try:
        producer.wait(timeout=180)
    except Exception:
        producer.kill()
        raise AssertionError(f"producer did not finish\n{fleet.all_logs()}") from None
    assert producer.returncode == 0, fleet.all_logs()

    time.sleep(0.5)  # the simulator logs a request once its answer is out
    records = fleet.sim_requests()
    overlaps = _overlaps(records)
    print(f"requests: {len(records)} for {N_PROMPTS} prompts, sent while an earlier one was open: {len(overlaps)}")
    assert not overlaps, (overlaps, sorted((r["prompt"], r["start_s"], r["end_s"], r["status"]) for r in records))
    # Exactly one outcome per prompt: each kept once, none failed.
    kept = fleet.assert_exactly_once(redis_client, "L", N_PROMPTS)
    assert {r["id"] for r in kept} == {r["id"] for r in rows}
    assert not (fleet.out / "L" / "failed.jsonl").exists() or not (fleet.out / "L" / "failed.jsonl").read_text()
    assert read_rows(fleet.out, "L")
