"""Bounded load test: N concurrent keep-alive clients against a simulator, figures printed.

    python -m simulator.bench --concurrency 2000 --duration-s 30 --latency-median-ms 1000

Starts its own simulator process (a separate core from this client) unless ``--url`` is given.
Each client sends requests back to back until the time is up. The client is raw HTTP/1.1 on gevent
sockets, cheap next to the server, so the figures measure the server: requests it held at once
(sampled from ``/_sim/stats``), steady throughput (after a warm-up), observed against configured
latency, errors, and CPU of both sides. Exits 1 if any request failed or the server held, on
average, fewer than 90% of the clients at once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import gevent
from gevent import socket as gsocket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(host: str, port: int, path: str) -> Any:
    sock = gsocket.create_connection((host, port), timeout=10)
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    finally:
        sock.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Load:
    def __init__(self, host: str, port: int, max_tokens: int, *, until: float, warm: float) -> None:
        self.host, self.port, self.max_tokens = host, port, max_tokens
        self.until, self.warm = until, warm  # monotonic deadlines: stop sending / start counting
        self.next_index = 0
        self.latencies_s: list[float] = []  # of requests that started after the warm-up
        self.done_in_window = 0
        self.statuses: dict[int, int] = {}
        self.errors: dict[str, int] = {}

    def _request(self, i: int) -> bytes:
        body = json.dumps({"model": "moonshotai/kimi-k2.5", "max_tokens": self.max_tokens,
                           "messages": [{"role": "user", "content": f"bench prompt {i}"}]}).encode()
        head = (f"POST /api/v1/chat/completions HTTP/1.1\r\nHost: sim\r\n"
                f"Authorization: Bearer bench\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    def client(self) -> None:
        sock = None
        while time.monotonic() < self.until:
            i = self.next_index
            self.next_index += 1
            try:
                if sock is None:
                    sock = gsocket.create_connection((self.host, self.port), timeout=120)
                    rfile = sock.makefile("rb")
                t0 = time.monotonic()
                sock.sendall(self._request(i))
                status = int(rfile.readline().split()[1])
                length = 0
                while (line := rfile.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                rfile.read(length)
                t1 = time.monotonic()
                if t0 >= self.warm:
                    self.latencies_s.append(t1 - t0)
                if self.warm <= t1 <= self.until:
                    self.done_in_window += 1
                self.statuses[status] = self.statuses.get(status, 0) + 1
            except (OSError, ValueError, IndexError) as exc:
                name = type(exc).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                if sock is not None:
                    sock.close()
                sock = None
        if sock is not None:
            sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running simulator (default: start one)")
    parser.add_argument("--concurrency", type=int, default=2000)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--latency-median-ms", type=float, default=1000.0)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--log-level", default="INFO", help="of the simulator started here")
    parser.add_argument("--tokenizer", help="tokenizer dir for the simulator started here")
    args = parser.parse_args(argv)

    proc = None
    if args.url:
        parts = urlsplit(args.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
    else:
        host, port = "127.0.0.1", _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "simulator", "--host", host, "--port", str(port),
             "--latency-median-ms", str(args.latency_median_ms), "--log-level", args.log_level,
             *(["--tokenizer", args.tokenizer] if args.tokenizer else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _get_json(host, port, "/_sim/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                gevent.sleep(0.1)
        t0 = time.monotonic()
        load = Load(host, port, args.max_tokens, until=t0 + args.duration_s,
                    warm=t0 + args.warmup_s)
        clients = [gevent.spawn(load.client) for _ in range(args.concurrency)]
        held: list[int] = []
        gevent.sleep(args.warmup_s)
        cpu0, mine0 = (_cpu_s(proc.pid) if proc else 0.0), _cpu_s(os.getpid())
        while time.monotonic() < load.until:
            held.append(_get_json(host, port, "/_sim/stats")["in_flight"])
            gevent.sleep(1.0)
        window_s = time.monotonic() - load.warm
        cpu_s = (_cpu_s(proc.pid) - cpu0) if proc else float("nan")
        mine_s = _cpu_s(os.getpid()) - mine0
        gevent.joinall(clients)
        stats = _get_json(host, port, "/_sim/stats")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)

    lat = sorted(load.latencies_s)
    print(f"simulator bench: {args.concurrency} concurrent clients for {args.duration_s:g} s "
          f"(first {args.warmup_s:g} s warm-up), configured latency median "
          f"{args.latency_median_ms:g} ms, p99 4x")
    print(f"  server held {min(held, default=0)}..{max(held, default=0)} requests at once "
          f"(mean {statistics.fmean(held) if held else 0:.0f}, sampled each second); "
          f"max {stats['max_in_flight']}")
    print(f"  steady throughput {load.done_in_window / window_s:,.0f} req/s; "
          f"{sum(load.statuses.values()):,} answered, statuses {load.statuses}, "
          f"client errors {load.errors or 'none'}")
    if lat:
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"  observed latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
              f"mean {statistics.fmean(lat) * 1000:.0f} ms")
    print(f"  billed {stats['billed_requests']:,} answers, "
          f"{stats['billed_completion_tokens']:,} completion tokens")
    if proc is not None:
        print(f"  CPU over the window: server {cpu_s / window_s:.0%} of one core, "
              f"bench client {mine_s / window_s:.0%}")
    # In-flight dips while a client turns around between requests, so judge the mean.
    ok = not load.errors and bool(held) and statistics.fmean(held) >= args.concurrency * 0.9
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
