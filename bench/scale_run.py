"""Any dataset size through a bounded Redis (issue 26): the queue window against a Redis of 256 MB.

    .venv/bin/python -m bench.scale_run --prompts 1000000 --to-the-end 100000

Generates prompts of ~4 KB under /tmp (never the repo), starts a private Valkey configured as
compose.yaml configures it (noeviction, AOF on) but with ``maxmemory 256mb``, the simulator and two
workers, and runs:

1. a budget run: ``--prompts`` prompts with a budget that stops after a few thousand rows, then a
   second dataset that runs to its end;
2. a run of ``--to-the-end`` prompts that goes to the end of its data (every prompt once: checked).

For each it prints Redis' peak memory (INFO used_memory_peak), the producer's peak RSS (VmHWM),
how fast the producer streams the file (prompts read per second, the whole file counted), the time
from the producer's start to the first request the simulator saw, and the switch time (budget stop
to the next dataset's first queued prompts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from harness.chaos import RestartableValkey
from harness.fleet import Fleet, read_rows

MAXMEMORY = 256 << 20
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex the river banks "
          "and every answer must be checked twice before it is written down ")


def write_prompts(path: Path, n: int, size_bytes: int, prefix: str) -> Path:
    text = (_WORDS * (size_bytes // len(_WORDS) + 2))
    with path.open("w") as fh:
        for i in range(n):
            start = i % 97
            content = f"Case {i}: {text[start:start + size_bytes]}"
            fh.write(json.dumps({"id": f"{prefix}{i:07d}", "messages": [{"role": "user", "content": content}]}))
            fh.write("\n")
    return path


@dataclass
class Figures:
    redis_peak_bytes: int = 0
    producer_peak_rss_kib: int = 0
    first_request_s: float | None = None
    wall_s: float = 0.0


def _watch(fleet: Fleet, client: redis.Redis, figures: Figures, started: float, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        proc = fleet.procs.get("producer")
        if proc is not None:
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        figures.producer_peak_rss_kib = max(figures.producer_peak_rss_kib, int(line.split()[1]))
            except OSError:
                pass
        if figures.first_request_s is None:
            try:
                if fleet.sim_stats().get("requests", 0) > 0:
                    figures.first_request_s = time.time() - started
            except Exception:
                pass


def _run(tmp: Path, datasets: list[dict[str, Any]], workers: int, greenlets: int, latency_ms: int,
         window: dict[str, str]) -> tuple[Fleet, Figures, dict[str, dict[str, Any]], str, int]:
    valkey = RestartableValkey(tmp / "valkey")
    valkey.start()
    client = redis.Redis.from_url(valkey.url)
    client.config_set("maxmemory", str(MAXMEMORY))
    fleet = Fleet(tmp, valkey.url)
    figures = Figures()
    stop = threading.Event()
    try:
        fleet.start_simulator("--latency-median-ms", str(latency_ms))
        config = fleet.write_config(datasets, timeout_s=60, estimate_tokens=250)
        for i in range(workers):
            fleet.start_worker(f"scale{i + 1}", concurrency=greenlets)
        for i in range(workers):  # "first request" then measures the producer, not a worker's start
            fleet.wait_ready(f"scale{i + 1}", timeout_s=600)
        started = time.time()
        watcher = threading.Thread(target=_watch, args=(fleet, client, figures, started, stop), daemon=True)
        watcher.start()
        fleet.run_producer(config, timeout_s=6 * 3600, env=window)
        figures.wall_s = time.time() - started
        stop.set()
        watcher.join()
        figures.redis_peak_bytes = int(client.info("memory")["used_memory_peak"])
        summaries = {d["name"]: json.loads((fleet.out / d["name"] / "summary.json").read_text()) for d in datasets}
        done_bytes = int(client.memory_usage(f"specfleet:ds:{datasets[0]['name']}:done", samples=0) or 0)
        settled_bytes = int(client.memory_usage(f"specfleet:ds:{datasets[0]['name']}:settled", samples=0) or 0)
        per_row = (done_bytes, settled_bytes)
        log = fleet.log("producer")
        oom = sum(fleet.log(n).count(word) for n in fleet.procs for word in ("OOM command", "OutOfMemoryError"))
        kept = summaries[datasets[0]["name"]]["results"]
        print(f"  done set {per_row[0]:,} B, settled {per_row[1]:,} B for {kept:,} rows (MEMORY USAGE): "
              f"{per_row[0] / max(kept, 1):.1f} + {per_row[1] / max(kept, 1):.1f} B per kept row")
        return fleet, figures, summaries, log, oom
    finally:
        stop.set()
        fleet.stop_all()
        client.close()
        valkey.stop()


def _read_rate(log: str, dataset: str) -> str:
    for line in log.splitlines():
        if f"{dataset}: " in line and "in the file, read in" in line:
            queued_of = line.split(f"{dataset}: ", 1)[1]
            n = int(queued_of.split(" of ")[1].split(" in the file")[0].replace(",", ""))
            seconds = float(queued_of.split("read in ")[1].split(" s")[0])
            queued = queued_of.split(" prompts")[0]
            return f"{n / seconds:,.0f} prompts/s read ({n:,} in {seconds:.1f} s; {queued} queued)"
    return "?"


def _line(label: str, f: Figures, extra: str) -> str:
    first = "?" if f.first_request_s is None else f"{f.first_request_s:.2f} s"
    return (f"{label}: Redis peak {f.redis_peak_bytes / 2**20:.1f} MiB of {MAXMEMORY >> 20} · producer peak RSS "
            f"{f.producer_peak_rss_kib / 1024:.0f} MiB · first request {first} · {extra} · wall {f.wall_s:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="100000,1000000",
                    help="the budget run's first dataset, one run per size (comma-separated)")
    ap.add_argument("--to-the-end", type=int, default=100_000, help="the run that goes to the end of its data")
    ap.add_argument("--prompt-bytes", type=int, default=4_000)
    ap.add_argument("--budget-tokens", type=int, default=1_500_000, help="~2,500 rows at the simulator's lengths")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--greenlets", type=int, default=200)
    ap.add_argument("--latency-median-ms", type=int, default=200)
    args = ap.parse_args()
    window: dict[str, str] = {}
    lines = []

    for size in [int(x) for x in args.prompts.split(",") if x.strip() and int(x)]:
        tmp = Path(tempfile.mkdtemp(prefix="specfleet-scale-budget-", dir="/tmp"))
        t = time.time()
        a = write_prompts(tmp / "a.jsonl", size, args.prompt_bytes, "a")
        b = write_prompts(tmp / "b.jsonl", 2_000, args.prompt_bytes, "b")
        print(f"budget run: {size:,} prompts, {a.stat().st_size / 2**30:.2f} GiB written in "
              f"{time.time() - t:.0f} s")
        _, f, s, log, oom = _run(tmp, [
            {"name": "A", "path": a, "length": "short", "budget_tokens": args.budget_tokens},
            {"name": "B", "path": b, "length": "short", "budget_tokens": 10**10},
        ], args.workers, args.greenlets, args.latency_median_ms, window)
        sa, sb = s["A"], s["B"]
        lines.append(_line(f"{size:,} prompts, budget stop", f,
                           f"A {sa['end_reason']} after {sa['results']:,} rows (file {sa['prompts']:,} prompts) · "
                           f"{_read_rate(log, 'A')} · switch {sa['switch_s']} s · B {sb['end_reason']} "
                           f"{sb['results']:,} rows · OOM lines {oom}"))
        print(lines[-1])

    if args.to_the_end:
        tmp = Path(tempfile.mkdtemp(prefix="specfleet-scale-end-", dir="/tmp"))
        e = write_prompts(tmp / "e.jsonl", args.to_the_end, args.prompt_bytes, "e")
        print(f"to-the-end run: {args.to_the_end:,} prompts, {e.stat().st_size / 2**30:.2f} GiB")
        fleet, f, s, log, oom = _run(tmp, [{"name": "E", "path": e, "length": "short", "budget_tokens": 10**12}],
                                     args.workers, args.greenlets, args.latency_median_ms, window)
        rows = read_rows(fleet.out, "E")
        ids = {r["id"] for r in rows}
        once = len(ids) == len(rows) == args.to_the_end
        lines.append(_line(f"{args.to_the_end:,} prompts, to the end", f,
                           f"{s['E']['end_reason']}: {len(rows):,} rows, {len(ids):,} distinct "
                           f"({'every prompt once' if once else 'NOT every prompt once'}) · {_read_rate(log, 'E')} · "
                           f"OOM lines {oom}"))
        print(lines[-1])
        if not once:
            return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
