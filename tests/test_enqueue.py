"""The hand-built task message (``producer/enqueue.py``, ~20× faster than ``apply_async``) is what
``apply_async`` pushes: same body, headers and properties, apart from what is new per message."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import msgpack
import pytest
import redis
from celery import Celery, Task

from common.contract import CONTRACT_VERSION, TASK_NAME, TaskPayload
from common.seal import ensure_key, seal
from common.settings import Settings
from producer.celery_app import make_app
from producer.enqueue import push, random_uuids

QUEUE = "specfleet.q.E"

#: New for every message (task id and its copies, kombu's delivery tag) or every sending process
#: (``origin``; ``reply_to`` is apply_async's per-thread reply address, unused without a result
#: backend). Everything else must be equal.
PER_MESSAGE_HEADERS = {"id", "root_id", "origin"}
PER_MESSAGE_PROPERTIES = {"correlation_id", "delivery_tag", "reply_to"}


def _payload(prompt_id: str = "p1") -> TaskPayload:
    return {"v": CONTRACT_VERSION, "run": "cfg123", "dataset": "E", "id": prompt_id, "where": "e.jsonl:1",
            "messages": [{"role": "user", "content": "héllo ✓ {{ jinja }}"}], "tools": None}


def _pop(client: redis.Redis) -> dict[str, Any]:
    raw = client.rpop(QUEUE)
    assert raw is not None and client.llen(QUEUE) == 0
    return json.loads(raw)  # type: ignore[no-any-return]


def _comparable(envelope: dict[str, Any]) -> dict[str, Any]:
    out = dict(envelope)
    out["body"] = base64.b64decode(envelope["body"])
    out["headers"] = {k: v for k, v in envelope["headers"].items() if k not in PER_MESSAGE_HEADERS}
    props = {k: v for k, v in envelope["properties"].items() if k not in PER_MESSAGE_PROPERTIES}
    out["properties"] = props
    return out


def _app(redis_client: redis.Redis) -> Celery:
    kwargs = redis_client.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"
    return make_app(Settings.from_env({}), url)


def _worker_task(monkeypatch: pytest.MonkeyPatch, app: Celery) -> Task:
    monkeypatch.setenv("REDIS_URL", app.conf.broker_url)  # the workers app reads it when its conf is first read
    from workers.celery import app as workers_app
    from workers.pipeline import task  # the app's include: its shared_task is declared on every app

    generate_task = workers_app.tasks[TASK_NAME]  # as the worker's app has it, with the worker's conf
    assert generate_task.name == task.generate_task.name == TASK_NAME
    return generate_task


# An id with what could break a hand-built template: a format directive, a quote, non-ASCII.
@pytest.mark.parametrize("prompt_id", ["p1", 'row %s "7" ✓ {0}'])
def test_the_hand_built_message_is_what_apply_async_pushes(redis_client: redis.Redis, prompt_id: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app(redis_client)
    payload = _payload(prompt_id)
    assert push(redis_client, app, QUEUE, [payload]) == 1
    ours = _pop(redis_client)

    argsrepr = f"({payload['dataset']}/{payload['id']})"
    # push seals the payload (common/seal.py): apply_async is given the sealed one.
    sealed: TaskPayload = {**payload, "seal": seal(ensure_key(redis_client, "E"), "E", prompt_id)}
    with app.producer_or_acquire() as producer:  # the task as workers declare it, sent to this Redis
        _worker_task(monkeypatch, app).apply_async(args=(sealed,), queue=QUEUE, argsrepr=argsrepr,
                                                   kwargsrepr="{}", producer=producer)
    theirs = _pop(redis_client)

    assert _comparable(ours) == _comparable(theirs)
    # The ids differ between the two, but each message's own copies agree, as the worker expects.
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]


def test_a_batch_is_pushed_in_order_with_one_id_per_message(redis_client: redis.Redis) -> None:
    app = _app(redis_client)
    payloads = [{**_payload(), "id": f"p{i}"} for i in range(5)]
    assert push(redis_client, app, QUEUE, payloads) == 5  # type: ignore[arg-type]
    popped = [json.loads(redis_client.rpop(QUEUE)) for _ in range(5)]  # type: ignore[arg-type]
    assert [m["headers"]["argsrepr"] for m in popped] == [f"(E/p{i})" for i in range(5)]  # FIFO for BRPOP
    assert len({m["headers"]["id"] for m in popped}) == 5


def test_the_ids_are_distinct_random_version_4_uuids() -> None:
    ids = random_uuids(2_000)
    parsed = [uuid.UUID(i) for i in ids]
    assert [str(u) for u in parsed] == ids  # canonical form, as uuid4() prints it
    assert {u.version for u in parsed} == {4} and {u.variant for u in parsed} == {uuid.RFC_4122}
    assert len(set(ids)) == len(ids)
    assert len({i[:8] for i in ids}) > 1_900  # random bits, not a counter


def test_a_worker_runs_only_what_the_producer_sealed(redis_client: redis.Redis) -> None:
    """The seal replaces a SET of every enqueued id: a pushed message passes the worker's check, the
    same payload with another id, or a seal under another dataset's key, does not."""
    from workers.fleet import poison

    app = _app(redis_client)
    push(redis_client, app, QUEUE, [_payload("p7")])
    raw = redis_client.rpop(QUEUE)
    assert raw is not None
    body = msgpack.unpackb(base64.b64decode(json.loads(raw)["body"]), raw=False)
    payload = body[0][0]
    assert redis_client.exists("specfleet:ds:E:ids") == 0  # no per-prompt state in Redis

    def check(p: dict[str, Any]) -> str | None:
        refusal = poison.check_task(redis_client, p, None, None, lambda run: ["E", "F"])
        return None if refusal is None else refusal.reason

    assert check(payload) is None
    assert check({**payload, "id": "p8"}) == poison.UNKNOWN_ID
    assert check({k: v for k, v in payload.items() if k != "seal"}) == poison.UNKNOWN_ID
    other = seal(ensure_key(redis_client, "F"), "F", "p7")
    assert check({**payload, "dataset": "F", "seal": other}) is None
    assert check({**payload, "seal": other}) == poison.UNKNOWN_ID
