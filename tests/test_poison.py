"""Poison messages: whatever lands in an active queue, the workers live and the run goes on.

Redis is shared infrastructure: anything can be pushed into a dataset's queue. Eleven kinds of bad
message are pushed into the active queue mid-run (real Valkey, two real gevent workers, the
simulator, the real producer); each is moved aside to the dead-letter list with its reason, no
worker dies or reconnects, and every prompt of the file still gets exactly one outcome.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid
from collections import Counter

import pytest
import redis

from common import keys
from common.contract import CONTRACT_VERSION, TaskPayload
from common.settings import Settings
from harness import zygote
from producer.celery_app import make_app
from producer.enqueue import MessageTemplate
from tests.fleet import REPO, Fleet, read_summary

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

N = 300


def _valid(queue: str, payload: TaskPayload, fleet: Fleet) -> dict:  # type: ignore[type-arg]
    """A message exactly as the producer pushes it, as a dict to spoil."""
    template = MessageTemplate(make_app(Settings.from_env(), fleet.redis_url), queue)
    return json.loads(template.render(payload, str(uuid.uuid4()), str(uuid.uuid4())))  # type: ignore[no-any-return]


def _with_body(message: dict, body: bytes) -> bytes:  # type: ignore[type-arg]
    return json.dumps({**message, "body": base64.b64encode(body).decode()}).encode()


def _poison(queue: str, config_id: str, fleet: Fleet) -> dict[str, bytes]:
    """Expected reason -> the raw message (one per kind; the reasons are the dead-letter words)."""
    payload: TaskPayload = {"v": CONTRACT_VERSION, "run": config_id, "dataset": "P", "id": "p00001",
                            "where": "p.jsonl:2", "messages": [{"role": "user", "content": "hi"}], "tools": None}
    valid = _valid(queue, payload, fleet)
    wrong_task = json.loads(json.dumps(valid))
    wrong_task["headers"]["task"] = "somebody.elses.task"
    return {
        "envelope:list": b"[1,2,3]",
        "not_json": b"\xff\xfe this is not JSON \x00\x01",
        "envelope:foo": b'{"foo":1}',
        "task_name": json.dumps(wrong_task).encode(),
        "contract_version": json.dumps(_valid(queue, {**payload, "v": 99}, fleet)).encode(),  # type: ignore[typeddict-item]
        "run": json.dumps(_valid(queue, {**payload, "run": "0" * 16}, fleet)).encode(),
        "unknown_id": json.dumps(_valid(queue, {**payload, "id": "not-in-the-file"}, fleet)).encode(),
        "body:not_msgpack": _with_body(valid, b"\xc1 this is not msgpack"),
        "body:empty": _with_body(valid, b""),
        "body:huge": _with_body(valid, b"\xc1" * 3_000_000),
        "dataset": json.dumps(_valid(queue, {**payload, "dataset": "NotInThisRun"}, fleet)).encode(),
    }


def test_poison_messages_are_dead_lettered_and_never_stop_a_worker(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "400")
    config = fleet.one_dataset("P", N)
    workers = [fleet.start_worker("w1", concurrency=15), fleet.start_worker("w2", concurrency=15)]
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "P", 40, timeout_s=120)
    queue = keys.queue("P")
    config_id = redis_client.hget(keys.ACTIVE_QUEUES, queue)
    assert config_id is not None
    poison = _poison(queue, config_id.decode(), fleet)
    # RPUSH: the BRPOP end, so they are taken next, mid-run, between good messages.
    for raw in poison.values():
        redis_client.rpush(queue, raw)

    try:
        code = producer.wait(timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run did not finish\n" + fleet.all_logs()) from None
    assert code == 0, fleet.all_logs()

    for name, proc in zip(("w1", "w2"), workers, strict=True):
        assert proc.poll() is None, f"worker {name} died\n{fleet.log(name)}"
        log = fleet.log(name)
        assert "Unrecoverable error" not in log, log[-6000:]
        assert "Traceback" not in log, log[-6000:]
        # Dropping the broker connection redelivers everything the worker holds: never for a bad message.
        assert "Connection to broker lost" not in log, log[-6000:]

    fleet.assert_exactly_once(redis_client, "P", N)
    summary = read_summary(fleet.out, "P")
    assert (summary["results"], summary["failed"], summary["skipped"]) == (N, 0, 0), summary
    assert summary["dead_letters"] == len(poison), summary

    entries = [json.loads(e) for e in redis_client.lrange(keys.DEAD_LETTERS, 0, -1)]
    got = Counter(e["reason"] for e in entries)
    want = Counter(reason.split(":")[0] for reason in poison)
    assert got == want, entries
    for e in entries:
        assert e["queue"] == queue and e["detail"] and e["received_at"] > 0 and e["worker"], e
        raw = base64.b64decode(e["raw_b64"])
        assert len(raw) <= keys.DEAD_LETTER_RAW_BYTES and e["bytes"] >= len(raw), e
    huge = next(e for e in entries if e["bytes"] > 1_000_000)
    assert huge["reason"] == "body" and huge["truncated"], huge
    # The eleven are counted apart: nothing of the dataset's accounting moved.
    assert redis_client.hlen(keys.DatasetKeys("P").failed) == 0
    assert not redis_client.sismember(keys.DatasetKeys("P").done, "not-in-the-file")

    status = zygote.run([sys.executable, "-m", "producer.cli", "status"], env=fleet.env(), cwd=REPO,
                        timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"dead letters: {len(poison)}" in status.stdout + status.stderr, status.stdout + status.stderr
