"""Poison messages: what a worker refuses to run, and where it goes instead (the dead-letter list).

Redis is shared infrastructure: anything can land in a dataset's queue. Each check is made at the
first place that can make it:

- **When the message is read** (``admit``, which workers/runtime/kombu_redis.py calls for every message it
  takes from a queue, before kombu or Celery see it; local work, no Redis): it must be a kombu
  envelope (a JSON object with a string delivery tag, a delivery info naming the queue it was read
  from, headers), name our task, and carry a base64 msgpack body of Celery's shape (args, kwargs,
  embed) whose one argument is a ``TaskPayload`` of our contract version. Without this, a JSON list
  or stray bytes raised inside kombu's read and stopped the worker ("Unrecoverable error"), and a
  JSON object without properties made it drop and rebuild its broker connection.
- **Before the prompt's first step** (``check_task``, from workers/pipeline/task.py; Redis reads, so in the
  task's own greenlet): the payload's run must be the run its queue serves (``keys.ACTIVE_QUEUES``),
  its dataset the queue's and one of the run's, and its id one the producer sealed (``seal``: an
  HMAC of the id under the dataset's key, common/seal.py; the key is read once per process and again
  when a seal does not match it). An id not in the file would otherwise be asked,
  paid for and counted as one of the dataset's prompts (a row, or a failure, of a prompt the file
  does not have, and the run's "every prompt has an outcome" reached one real prompt early).

A refused message is written to ``keys.DEAD_LETTERS`` (newest first, the last ``DEAD_LETTER_MAX``)
as JSON {reason, detail, queue, received_at, worker, bytes, truncated, raw_b64 — its first
``DEAD_LETTER_RAW_BYTES``, API keys scrubbed}, counted per queue in ``keys.DEAD_LETTER_COUNTS``,
logged in one line, and removed: it never reaches the budget, so it is no prompt of the dataset.
When Redis cannot take the entry (away, or refusing writes), a message refused at its read is
dropped with its log line (nothing could run it), and one refused by its task waits with it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from common import keys, seal
from common.contract import CONTRACT_VERSION, IDLE_QUEUE, TASK_NAME
from common.errors import PoisonMessage
from common.redis_client import UNREACHABLE, deadline
from workers import WORKER_ID

log = logging.getLogger(__name__)

#: What takes the API keys out of a dead letter's raw bytes: ``RedactSecrets(settings.secrets).scrub``
#: (``WorkerContext.scrub``), handed in by the caller; this module reads no environment.
Scrub = Callable[[str], str]

#: The reasons, stable words for the list's readers. A message that is not JSON; JSON that is not a
#: kombu envelope of a queue message; another task's; a body that is not our msgpack (empty, base64
#: or msgpack broken, another content type); a payload that is not a ``TaskPayload``; another
#: contract version; another run than the queue's; a dataset not the queue's or not the run's; an
#: id the producer never enqueued.
NOT_JSON, ENVELOPE, TASK_NAME_REASON, BODY, PAYLOAD = "not_json", "envelope", "task_name", "body", "payload"
VERSION, RUN, DATASET, UNKNOWN_ID = "contract_version", "run", "dataset", "unknown_id"

#: How long a dead-letter write waits for an unreachable Redis: the consumer's own greenlet waits.
WRITE_WAIT_S = 2.0
_CONTENT_TYPE = "application/x-msgpack"
_FIELDS: dict[str, type | tuple[type, ...]] = {"run": str, "dataset": str, "id": str, "where": str,
                                                "messages": list, "tools": (list, type(None))}


@dataclass(frozen=True)
class Refusal:
    reason: str
    detail: str


def inspect(raw: bytes, queue: str) -> dict[str, Any]:
    """The envelope of a message read from ``queue``, for kombu to deliver; raises ``PoisonMessage``."""
    try:
        envelope = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise PoisonMessage(NOT_JSON, f"not JSON: {exc}") from None
    if not isinstance(envelope, dict):
        raise PoisonMessage(ENVELOPE, f"a JSON {type(envelope).__name__}, not a message envelope")
    props, headers = envelope.get("properties"), envelope.get("headers")
    if not isinstance(props, dict) or not isinstance(props.get("delivery_tag"), str):
        raise PoisonMessage(ENVELOPE, "no properties with a delivery tag")
    info = props.get("delivery_info")
    if not isinstance(info, dict) or info.get("routing_key") != queue:
        # kombu puts an unacked message back where its routing key says: it must be this queue.
        raise PoisonMessage(ENVELOPE, f"delivery info {info!r:.80} does not name the queue it was read from")
    if not isinstance(headers, dict):
        raise PoisonMessage(ENVELOPE, "no headers")
    if headers.get("task") != TASK_NAME:
        raise PoisonMessage(TASK_NAME_REASON, f"task {headers.get('task')!r:.80}, this worker runs {TASK_NAME!r} only")
    if not isinstance(headers.get("id"), str):
        raise PoisonMessage(ENVELOPE, "no task id")
    payload = _payload(envelope, props)
    version = payload.get("v")
    if version != CONTRACT_VERSION:
        raise PoisonMessage(VERSION, f"contract version {version!r:.20}, this worker speaks {CONTRACT_VERSION}")
    for name, kind in _FIELDS.items():
        if not isinstance(payload.get(name), kind):
            raise PoisonMessage(PAYLOAD, f"field {name!r} is {type(payload.get(name)).__name__}")
    return envelope


def _payload(envelope: dict[str, Any], props: dict[str, Any]) -> dict[str, Any]:
    content_type = envelope.get("content-type")
    if content_type != _CONTENT_TYPE or props.get("body_encoding") != "base64":
        raise PoisonMessage(BODY, f"content type {content_type!r:.60} ({props.get('body_encoding')!r:.20}), "
                           f"this worker accepts {_CONTENT_TYPE} in base64 only")
    body = envelope.get("body")
    if not isinstance(body, str) or not body:
        raise PoisonMessage(BODY, "empty body")
    try:
        decoded = msgpack.unpackb(base64.b64decode(body, validate=True), raw=False)
    except (binascii.Error, ValueError, msgpack.UnpackException) as exc:
        raise PoisonMessage(BODY, f"body is not base64 msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if not (isinstance(decoded, list | tuple) and len(decoded) == 3 and isinstance(decoded[0], list | tuple)
            and len(decoded[0]) == 1 and isinstance(decoded[0][0], dict)):
        raise PoisonMessage(PAYLOAD, "body is not (args, kwargs, embed) with one payload argument")
    payload: dict[str, Any] = decoded[0][0]
    return payload


def admit(client: redis.Redis, raw: bytes, queue: str, *, scrub: Scrub,
          unacked: tuple[str, str] | None = None) -> dict[str, Any] | None:
    """The envelope to deliver, or None: the message was dead-lettered (``unacked``: the unacked
    hash and index it was already recorded in, by workers/runtime/kombu_redis.py's multi-pop)."""
    if not queue.startswith(keys.QUEUE_PREFIX) and queue != IDLE_QUEUE:
        # Celery's own queues (a remote-control reply's routing key is its ticket, not the queue it
        # is read from): checked as tasks they were all refused, so no `inspect`, Flower or worker
        # healthcheck ever got an answer. Read as kombu reads them.
        return json.loads(raw)
    try:
        return inspect(raw, queue)
    except PoisonMessage as poison:
        record = None
        if unacked is not None:  # the multi-pop took only messages with a tag (its Lua decoder's reading)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = (unacked[0], unacked[1], str(json.loads(raw)["properties"]["delivery_tag"]))
        dead_letter(client, raw, queue, Refusal(poison.reason, poison.detail), scrub=scrub, unacked=record)
        return None


def check_task(client: redis.Redis, payload: dict[str, Any], queue: str | None, serves: str | None,
               run_datasets: Any) -> Refusal | None:
    """Whether a decoded payload is one of ours: None, or why not. ``serves``: the run this worker
    last saw the queue serve (None: ask Redis); ``run_datasets(run)``: the run's dataset names, or
    None when this Redis holds no such run."""
    run, dataset = payload["run"], payload["dataset"]
    if queue is not None and queue.startswith(keys.QUEUE_PREFIX):
        if run != serves:  # the worker's view may be a poll behind: Redis says
            active = client.hget(keys.ACTIVE_QUEUES, queue)
            serves = None if active is None else active.decode()
        if run != serves:
            return Refusal(RUN, f"run {run!r:.40}, but {queue} serves " + (f"run {serves}" if serves else "no run"))
        if queue != keys.queue(dataset):
            return Refusal(DATASET, f"dataset {dataset!r:.60} in the queue of {queue[len(keys.QUEUE_PREFIX):]!r}")
    datasets = run_datasets(run)
    if datasets is None:
        return Refusal(RUN, f"run {run!r:.40} is not in this Redis")
    if dataset not in datasets:
        return Refusal(DATASET, f"run {run} has no dataset {dataset!r:.60}")
    if not _sealed(client, dataset, payload["id"], payload.get("seal")):
        return Refusal(UNKNOWN_ID, f"{dataset}/{payload['id']!s:.80} was never enqueued: not a prompt of the file")
    return None


#: Dataset -> its seal key, as this process last read it.
_SEAL_KEYS: dict[str, bytes] = {}


def _sealed(client: redis.Redis, dataset: str, prompt_id: str, claimed: object) -> bool:
    key = _SEAL_KEYS.get(dataset)
    if key is not None and seal.sealed(key, dataset, prompt_id, claimed):
        return True
    # Not read yet, or the key changed (a Redis that lost it and a producer that made another).
    key = seal.read_key(client, dataset)
    if key is None:
        return False
    _SEAL_KEYS[dataset] = key
    return seal.sealed(key, dataset, prompt_id, claimed)


def dead_letter(client: redis.Redis, raw: bytes, queue: str, refusal: Refusal, *, scrub: Scrub,
                unacked: tuple[str, str, str] | None = None) -> bool:
    """Move a refused message aside (``unacked``: hash, index and tag of its unacked record, removed
    in the same round trip); False when Redis could not take it (logged)."""
    kept = raw[:keys.DEAD_LETTER_RAW_BYTES]
    entry = {"reason": refusal.reason, "detail": refusal.detail, "queue": queue, "received_at": round(time.time(), 3),
             "worker": WORKER_ID, "bytes": len(raw), "truncated": len(raw) > len(kept),
             # latin-1 maps bytes to text one to one, so the scrub can see a key in any bytes.
             "raw_b64": base64.b64encode(scrub(kept.decode("latin-1")).encode("latin-1")).decode()}
    pipe = client.pipeline(transaction=False)
    pipe.lpush(keys.DEAD_LETTERS, json.dumps(entry))
    pipe.ltrim(keys.DEAD_LETTERS, 0, keys.DEAD_LETTER_MAX - 1)
    pipe.hincrby(keys.DEAD_LETTER_COUNTS, queue, 1)
    if unacked is not None:
        hash_key, index_key, tag = unacked
        pipe.hdel(hash_key, tag)
        pipe.zrem(index_key, tag)
    try:
        with deadline(WRITE_WAIT_S):
            pipe.execute()
    except (*UNREACHABLE, redis.RedisError) as exc:
        log.warning("dead letter from %s not recorded (%s, %d bytes): %s: %s", queue, refusal.reason, len(raw),
                    type(exc).__name__, exc)
        return False
    log.warning("dead letter from %s: %s: %s (%d bytes): moved to %s", queue, refusal.reason, refusal.detail,
                len(raw), keys.DEAD_LETTERS)
    return True
