"""Chaos soak: a run that meets every fault at once, and the figures that say nothing was lost.

    .venv/bin/python bench/soak.py                  # make soak: 10,000 prompts
    .venv/bin/python bench/soak.py --prompts 1500   # smaller, while developing

A private Valkey with AOF (appendfsync everysec) on a fixed port, the simulator with 5% each of
429, 502, hang, bad JSON and 200-with-error, worker processes of which one is SIGKILLed and a new
one started every 5–10 s, and Redis SIGKILLed and restarted (3 s later, same port and data) twice
mid-run. The producer's idle-queue sweep is pushed out of the way (``--stall-s``) so a killed
worker's tasks can only come back by the visibility timeout.

Every worker process sends its own ``X-Title``, and the simulator's request log
(``/_sim/requests``) records who asked which prompt when; the ledger says which answers were
delivered. A prompt is *asked again* when a request for it starts after a delivered answer, or
comes from another worker than the previous request; the repeat is the killed worker's if the
worker that asked before was SIGKILLed after its request started, and anything else otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import redis
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.budget import Budget  # noqa: E402
from common.throttle import FleetThrottle  # noqa: E402
from simulator.seeding import prompt_hash  # noqa: E402
from tests.chaos import RestartableValkey  # noqa: E402
from tests.fleet import Fleet, read_rows, write_jsonl  # noqa: E402

FAULTS = ("429", "502", "hang", "bad_json", "error200")
DATASET = "SOAK"


def soak_prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"s{i:06d}", "messages": [
        {"role": "user", "content": f"Soak case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


class Chaos:
    """Kills a worker every 5–10 s (and starts another), and Redis twice."""

    def __init__(self, fleet: Fleet, valkey: RestartableValkey, args: argparse.Namespace) -> None:
        self.fleet, self.valkey, self.args = fleet, valkey, args
        self.rng = random.Random(args.seed)
        self.live: list[str] = []
        self.worker_kills: list[tuple[float, str]] = []  # (time.time(), X-Title of the killed worker)
        self.redis_kills: list[float] = []
        self.stop = threading.Event()
        self._n = 0
        self.started_s = 0.0

    def start_worker(self) -> None:
        self._n += 1
        name = f"soak-w{self._n:02d}"
        self.fleet.start_worker(name, concurrency=self.args.concurrency, SPECFLEET_APP_TITLE=name,
                                SPECFLEET_LOG_LEVEL="WARNING", **self.args.worker_env)
        self.live.append(name)

    def kill_worker(self) -> None:
        name = self.rng.choice(self.live)
        self.fleet.procs[name].send_signal(signal.SIGKILL)
        self.fleet.procs[name].wait()
        self.worker_kills.append((time.time(), name))
        self.live.remove(name)
        self.start_worker()

    def kill_redis(self) -> None:
        self.valkey.kill()
        self.redis_kills.append(time.time())
        time.sleep(3)
        self.valkey.start()

    def run(self, producer: subprocess.Popen[bytes], redis_at: list[float]) -> None:
        # The clock starts once rows land: workers loading their tokenizer are not "mid-run".
        client = redis.Redis.from_url(self.valkey.url, socket_timeout=10)
        while producer.poll() is None and Budget(client, DATASET).snapshot().rows < 50:
            time.sleep(0.2)
        self.started_s = time.time()
        started = time.monotonic()
        pending_redis = sorted(redis_at)
        next_worker_kill = started + self.rng.uniform(5, 10)
        while not self.stop.is_set() and producer.poll() is None:
            now = time.monotonic()
            if pending_redis and now - started >= pending_redis[0]:
                pending_redis.pop(0)
                self.kill_redis()
            elif now >= next_worker_kill and now - started < self.args.chaos_s:
                self.kill_worker()
                next_worker_kill = now + self.rng.uniform(5, 10)
            time.sleep(0.2)


class ThrottleWatch(threading.Thread):
    """The fleet throttle's state once a second (the random 429s must not hold the fleet back)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.throttle = FleetThrottle(client)
        self.samples: list[tuple[float | None, bool, float]] = []  # (limit, paused, background share)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            try:
                snap = self.throttle.snapshot()
            except redis.RedisError:  # Redis SIGKILLed by the chaos: no sample
                continue
            self.samples.append((snap.limit, snap.pause_ms_left > 0, snap.background_share))

    def line(self, greenlets: int) -> str:
        n = len(self.samples)
        if not n:
            return "throttle: no samples"
        limits = [limit for limit, _, _ in self.samples if limit is not None]
        held = sum(1 for limit in limits if limit < 0.9 * greenlets)
        paused = sum(1 for _, p, _ in self.samples if p)
        lowest = f" (lowest {min(limits):.0f})" if limits else ""
        return (f"throttle: limit under 90% of the fleet's {greenlets} greenlets {100 * held / n:.0f}% of the time"
                f"{lowest}, fleet paused {100 * paused / n:.0f}% of the time, background 429 share at the end "
                f"{100 * self.samples[-1][2]:.1f}%")


def asked_twice(records: list[dict[str, Any]], delivered: set[str], kills: dict[str, float],
                hash_to_id: dict[str, str]) -> tuple[Counter[str], list[float], dict[str, list[str]]]:
    """Repeats by cause, the delay from each worker kill to its prompts being asked again, examples."""
    by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["prompt"] in hash_to_id:
            by_prompt[r["prompt"]].append(r)
    causes: Counter[str] = Counter()
    delays: list[float] = []
    examples: dict[str, list[str]] = defaultdict(list)
    for h, reqs in by_prompt.items():
        reqs.sort(key=lambda r: r["start_s"])
        answered_at: float | None = None  # end of the first answer its client received
        for prev, cur in itertools.pairwise(reqs):
            if prev["gen_id"] in delivered:
                answered_at = prev["end_s"] if answered_at is None else min(answered_at, prev["end_s"])
            again = cur["app"] != prev["app"] or (answered_at is not None and answered_at <= cur["start_s"])
            if not again:
                continue
            # Every request of a killed worker precedes its death (the simulator may log one that
            # was still in its accept queue a few ms after the kill).
            killed_at = kills.get(prev["app"])
            if killed_at is not None:
                causes["killed worker's in-flight request"] += 1
                delays.append(cur["start_s"] - killed_at)
            else:
                causes["anything else"] += 1
                examples["anything else"].append(hash_to_id[h])
            answered_at = None
    return causes, delays, examples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--visibility-timeout-s", type=int, default=40)
    ap.add_argument("--restore-s", type=float, default=5.0)
    ap.add_argument("--latency-median-ms", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout-s", type=float, default=900, help="give up on the run after this long")
    args = ap.parse_args()
    args.worker_env = {"SPECFLEET_VISIBILITY_TIMEOUT_S": str(args.visibility_timeout_s),
                       "SPECFLEET_UNACKED_RESTORE_S": str(args.restore_s)}

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-soak-"))
    valkey = RestartableValkey(tmp / "valkey")
    valkey.start()
    fleet = Fleet(tmp, valkey.url)
    client = redis.Redis.from_url(valkey.url, socket_timeout=30)
    items = soak_prompts(args.prompts)
    chaos = Chaos(fleet, valkey, args)
    watch = ThrottleWatch(client)
    t0 = time.time()
    try:
        fault_args = [a for f in FAULTS for a in ("--fault", f"{f}=0.05")]
        # hang holds past the request timeout: the worker gives up and retries (and is billed).
        fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms), "--hang-s", "8", *fault_args)
        data = write_jsonl(tmp / "soak.jsonl", items)  # type: ignore[arg-type]
        config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                      "budget_tokens": 1_000_000_000}], timeout_s=6, estimate_tokens=600)
        for _ in range(args.workers):
            chaos.start_worker()
        time.sleep(3)
        # Rough run length: admission at ~args.workers × concurrency / latency prompts per second.
        per_s = args.workers * args.concurrency / (args.latency_median_ms / 1000 + 0.5)
        expect_s = max(40.0, args.prompts / per_s)
        args.chaos_s = expect_s * 0.9
        cmd = [sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress", "--stall-s", "150"]
        env = fleet.env(SPECFLEET_VISIBILITY_TIMEOUT_S=str(args.visibility_timeout_s))
        producer = fleet._spawn("producer", cmd, env)
        watch.start()
        chaos_thread = threading.Thread(target=chaos.run, args=(producer, [expect_s * 0.3, expect_s * 0.65]),
                                        daemon=True)
        chaos_thread.start()
        try:
            exit_code = producer.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            producer.kill()
            exit_code = -1
        chaos.stop.set()
        chaos_thread.join()
        watch.halt.set()
        wall_s = time.time() - t0
        sim = fleet.sim_url
        records = requests.get(sim + "/_sim/requests", timeout=60).json()["requests"]
        ledger = requests.get(sim + "/_sim/stats?detail=1", timeout=60).json()
        rows = read_rows(fleet.out, DATASET)
        budget = Budget(client, DATASET).snapshot()
        failed_lines = (fleet.out / DATASET / "failed.jsonl")
        failures = [json.loads(x) for x in failed_lines.read_text().splitlines()] if failed_lines.exists() else []
        summary_path = fleet.out / DATASET / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        sweeps = fleet.log("producer").count("re-enqueued")
        (tmp / "requests.json").write_text(json.dumps(records))  # for a post-mortem
        (tmp / "ledger.json").write_text(json.dumps(ledger))
        (tmp / "kills.json").write_text(json.dumps({"workers": chaos.worker_kills, "redis": chaos.redis_kills}))
    finally:
        fleet.stop_all()
        valkey.stop()

    delivered = {g["id"] for g in ledger.get("generations", [])
                 if not g["abandoned"] and g["fault"] not in ("bad_json", "hang")}
    kills = {name: t for t, name in chaos.worker_kills}
    hash_to_id = {prompt_hash(p["messages"]): p["id"] for p in items}
    causes, delays, examples = asked_twice(records, delivered, kills, hash_to_id)
    ids = Counter(r["id"] for r in rows)
    failed_ids = {f["id"] for f in failures}
    without = len(set(hash_to_id.values()) - set(ids) - failed_ids)
    by_reason = Counter(f["reason"] for f in failures)
    kept_tokens = sum(int(r["num_tokens"]) for r in rows)

    print(f"soak: {args.prompts:,} prompts, {len(chaos.worker_kills) + args.workers} worker processes "
          f"({len(chaos.worker_kills)} SIGKILLed), Redis SIGKILLed {len(chaos.redis_kills)}× (at "
          f"{', '.join(f'{t - chaos.started_s:.0f}' for t in chaos.redis_kills)} s after the first rows), faults "
          f"{', '.join(f'{f} 5%' for f in FAULTS)}; visibility timeout {args.visibility_timeout_s} s, "
          f"unacked restore every {args.restore_s:g} s; producer exit {exit_code}")
    print(f"prompts kept: {len(ids):,} · failed: {len(failed_ids):,} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_reason.items())) or '-'}) · without outcome: {without}")
    print(f"duplicate rows: {sum(c - 1 for c in ids.values() if c > 1)}")
    killed = causes["killed worker's in-flight request"]
    print(f"prompts asked twice: killed worker's in-flight requests {killed} · anything else {causes['anything else']}"
          + (f" (e.g. {', '.join(examples['anything else'][:5])})" if examples["anything else"] else ""))
    counter_kept, counter_rows = budget.kept, budget.rows
    same = counter_kept == kept_tokens and counter_rows == len(rows)
    print(f"budget counter: kept {counter_kept:,} tokens in {counter_rows:,} rows · rows on disk: "
          f"{kept_tokens:,} tokens in {len(rows):,} rows · {'equal' if same else 'DIFFERENT'}")
    if delays:
        print(f"redelivery after a worker kill (kill → asked again): median {statistics.median(delays):.1f} s, "
              f"max {max(delays):.1f} s over {len(delays)} prompts; bound visibility "
              f"{args.visibility_timeout_s} s + restore {args.restore_s:g} s + pickup")
    else:
        print("redelivery after a worker kill: no killed worker had a request in flight")
    print(watch.line(args.workers * args.concurrency))
    print(f"requests {len(records):,} · billed {ledger.get('billed_requests', 0):,} · idle-queue sweeps "
          f"{sweeps} · end {summary.get('end_reason', '?')} · wall time {wall_s:.1f} s · dir {tmp}")
    ok = (exit_code == 0 and without == 0 and not any(c > 1 for c in ids.values())
          and causes["anything else"] == 0 and same)
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
