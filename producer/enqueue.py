"""Batched enqueue: a dataset's prompts become Celery task messages, pushed a thousand at a time.

``apply_async`` costs one Redis round trip per task (100k prompts ≈ a minute); here the messages
are built with Celery's own ``as_task_v2`` and LPUSHed in one command; ``tests/test_enqueue.py``
proves they equal what ``generate_task.apply_async`` pushes, apart from per-message ids. kombu's
Redis transport BRPOPs from the other end: FIFO.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
from collections.abc import Iterable, Sequence
from json.encoder import encode_basestring_ascii
from operator import itemgetter
from typing import Any, NamedTuple, Protocol

import msgpack
import redis
from celery import Celery
from kombu.serialization import dumps

from common.contract import TASK_NAME, TaskPayload
from common.seal import ensure_key, seal

_ORIGIN = f"specfleet-producer@{socket.gethostname()}:{os.getpid()}"


#: Stand-ins for what differs between messages, replaced in a JSON template built once per batch.
_ID, _ARGSREPR, _TAG, _BODY = "\x00id\x00", "\x00argsrepr\x00", "\x00tag\x00", "\x00body\x00"
_MARKER = re.compile(r'"\\u0000(id|argsrepr|tag|body)\\u0000"')


def _envelope(app: Celery, queue: str, task_id: str, argsrepr: str, body: str, tag: str,
              args: tuple[Any, ...]) -> dict[str, Any]:
    msg = app.amqp.as_task_v2(
        task_id,
        TASK_NAME,
        args=args,
        kwargs={},
        argsrepr=argsrepr,
        kwargsrepr="{}",
        origin=_ORIGIN,
        # As the task is declared (workers/pipeline/task.py): a False here would override it on the worker.
        ignore_result=True,
    )
    return {
        "body": body,
        "content-encoding": "binary",
        "content-type": "application/x-msgpack",
        "headers": msg.headers,
        "properties": {
            # apply_async(argsrepr=…) passes them on to kombu, which keeps them as properties.
            "argsrepr": argsrepr,
            "kwargsrepr": "{}",
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": tag,
        },
    }


class MessageTemplate:
    """The kombu/Redis envelope ``generate_task.apply_async(queue=queue)`` would push, as a JSON
    template: Celery builds the headers once, and each message only fills in its task id, argsrepr,
    delivery tag and body (a sixth of the cost of building every envelope with ``as_task_v2``)."""

    def __init__(self, app: Celery, queue: str) -> None:
        content_type, content_encoding, _ = dumps(((), {}, {}), serializer="msgpack")
        envelope = _envelope(app, queue, _ID, _ARGSREPR, _BODY, _TAG, ())
        envelope["content-type"], envelope["content-encoding"] = content_type, content_encoding
        text = json.dumps(envelope, separators=(",", ":"))
        parts = _MARKER.split(text)  # literal, name, literal, name, …, literal
        # One bytes %-format per message (half the cost of str.format, and no encode after it): the
        # literals with their % doubled, a %s per field, the fields picked in template order.
        self._format = "%s".join(part.replace("%", "%%") for part in parts[0::2]).encode()
        self._pick = itemgetter(*parts[1::2])
        _, _, embed = app.amqp.as_task_v2(_ID, TASK_NAME, args=(), kwargs={}).body
        self._embed = embed

    def render(self, payload: TaskPayload, task_id: str, tag: str) -> bytes:
        # kombu's msgpack serializer is exactly this call (kombu/serialization.py).
        body = msgpack.packb(((payload,), {}, self._embed), use_bin_type=True)
        fields = {
            "id": b'"' + task_id.encode() + b'"', "tag": b'"' + tag.encode() + b'"',
            # Celery would put repr(args) here: the whole prompt again. The id is enough for Flower.
            "argsrepr": encode_basestring_ascii(f"({payload['dataset']}/{payload['id']})").encode(),
            "body": b'"' + base64.b64encode(body) + b'"',
        }
        return self._format % self._pick(fields)


#: Byte maps that set a random UUID's version (4) and variant (RFC 4122) bits, as ``uuid.UUID`` does.
_VERSION_4 = bytes((b & 0x0F) | 0x40 for b in range(256))
_VARIANT_RFC_4122 = bytes((b & 0x3F) | 0x80 for b in range(256))


def random_uuids(n: int) -> list[str]:
    """``n`` random (version 4) UUIDs from one read of the OS's randomness, formatted from one hex
    string (``str(uuid.UUID(…))`` per id was 40% of building a batch)."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = raw[6::16].translate(_VERSION_4)
    raw[8::16] = raw[8::16].translate(_VARIANT_RFC_4122)
    h = raw.hex()
    return [f"{h[i:i + 8]}-{h[i + 8:i + 12]}-{h[i + 12:i + 16]}-{h[i + 16:i + 20]}-{h[i + 20:i + 32]}"
            for i in range(0, 32 * n, 32)]


class FencedWrite(Protocol):
    """The producer lock's fenced write (``producer/lock.py``)."""

    def write(self, *commands: Sequence[Any]) -> list[Any]: ...


class Pushed(NamedTuple):
    messages: int
    #: The messages' bytes as Redis stores them (the window's byte bound counts these).
    bytes: int


def push(client: redis.Redis, app: Celery, queue: str, payloads: Iterable[TaskPayload], *,
         fence: FencedWrite | None = None, seal_key: bytes | None = None) -> int:
    """``push_batch``, counting messages only."""
    return push_batch(client, app, queue, payloads, fence=fence, seal_key=seal_key).messages


def push_batch(client: redis.Redis, app: Celery, queue: str, payloads: Iterable[TaskPayload], *,
               fence: FencedWrite | None = None, seal_key: bytes | None = None) -> Pushed:
    """LPUSH one batch of task messages in one round trip, each payload sealed (common/seal.py:
    ``seal_key``, or the dataset's key read from Redis). ``fence``: pushed only while the producer
    lock is ours (a paused producer that lost it must not queue a stale batch beside the new holder's)."""
    batch = list(payloads)
    if not batch:
        return Pushed(0, 0)
    dataset = batch[0]["dataset"]
    key = seal_key if seal_key is not None else ensure_key(client, dataset)
    template = MessageTemplate(app, queue)
    ids = random_uuids(2 * len(batch))
    messages = [template.render({**p, "seal": seal(key, dataset, p["id"])}, ids[2 * i], ids[2 * i + 1])
                for i, p in enumerate(batch)]
    if fence is not None:
        fence.write(("LPUSH", queue, *messages))
    else:
        client.lpush(queue, *messages)
    return Pushed(len(messages), sum(map(len, messages)))
