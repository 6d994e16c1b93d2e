"""A batch's durable record in Redis: the intent written before the POST, and what follows it.

The order is what makes a second bill impossible: the intent (what will be asked, each request's
payload and budget lease, the leases made to outlive the batch) is written in one MULTI, fenced into
the AOF, *before* ``POST /api/v1/batches``; the batch id is recorded after. A worker that dies between
the two leaves an intent in state ``posting``; the next poller finds it (its poll lease lapsed) and
looks for the batch with ``GET /api/v1/batches?created_after=…`` before it would post again
(``poll.py``). Keys: ``common/keys.BatchKeys``, ``BATCHES_OPEN``, ``BATCH_CLAIMS``,
``DatasetKeys.batched``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from common import keys
from common.batches import DONE, SUBMITTED, Intent
from common.budget import Budget
from common.contract import TaskPayload
from common.keys import BatchKeys, DatasetKeys
from common.redis_client import FencedTransaction

#: A batch request's budget lease outlives the Batch API's 24 h window, with room for the settle.
BATCH_LEASE_MS = 26 * 3600 * 1000
#: How long a finished batch's record stays readable (``specfleet status``, a post-mortem).
DONE_KEEP_S = 7 * 24 * 3600


_RELEASE_IF_OURS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def custom_id(dataset: str, prompt_id: str) -> str:
    """The prompt's custom_id in any batch (≤ 64 characters, the same every time it is asked)."""
    return hashlib.sha256(f"{dataset}\0{prompt_id}".encode()).hexdigest()[:40]


@dataclass(frozen=True)
class Item:
    """One request of a batch, as recorded: enough for any worker to settle its result."""

    custom_id: str
    payload: TaskPayload
    lease: str

    def packed(self) -> bytes:
        return bytes(msgpack.packb({"payload": self.payload, "lease": self.lease}, use_bin_type=True))

    @classmethod
    def unpacked(cls, cid: str, raw: bytes) -> Item:
        d = msgpack.unpackb(raw, raw=False)
        return cls(cid, d["payload"], d["lease"])


def record_intent(client: redis.Redis, intent: Intent, items: list[Item], *, owner: str,
                  poll_ms: int) -> list[str]:
    """Before the POST: in one MULTI, each item's lease renewed to outlive the batch, the intent, its
    requests, the prompts marked batched, the batch open and this worker its poller (``poll_ms``: a
    POST's deadline and more, so nobody recovers a POST still on its way). Returns each lease's
    renewal word, in order; the caller drops items whose lease was not renewed (``drop``)."""
    k = BatchKeys(intent.id)
    budget = Budget(client, intent.dataset)
    for attempt in range(2):
        pipe = FencedTransaction(client)
        for item in items:
            budget.queue_renew(pipe, item.payload["id"], item.lease, ttl_ms=BATCH_LEASE_MS)
        pipe.hset(k.record, mapping=intent.fields())
        pipe.hset(k.requests, mapping={i.custom_id: i.packed() for i in items})
        pipe.hset(DatasetKeys(intent.dataset).batched, mapping={i.payload["id"]: intent.id for i in items})
        pipe.zadd(keys.BATCHES_OPEN, {intent.id: int(intent.created_s * 1000)})
        pipe.set(k.poller, owner, px=poll_ms)
        try:
            replies = pipe.execute_fenced()
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            budget.snapshot()  # a restarted server: a plain call loads the script again
            client.script_load(budget._script.script)
            continue
        return [r[0].decode() if isinstance(r[0], bytes) else str(r[0]) for r in replies[:len(items)]]
    raise AssertionError("unreachable")


def drop(client: redis.Redis, intent: Intent, items: list[Item]) -> None:
    """Before the POST: items that will not be asked (their lease was lost or their dataset stopped)."""
    if not items:
        return
    k = BatchKeys(intent.id)
    pipe = FencedTransaction(client)
    pipe.hdel(k.requests, *[i.custom_id for i in items])
    pipe.hdel(DatasetKeys(intent.dataset).batched, *[i.payload["id"] for i in items])
    pipe.hset(k.record, "n", intent.n)
    pipe.execute_fenced()


def record_submitted(client: redis.Redis, intent: Intent, batch_id: str) -> bool:
    """The batch id, once known; False when another intent claimed that batch already."""
    pipe = FencedTransaction(client)
    pipe.hsetnx(keys.BATCH_CLAIMS, batch_id, intent.id)
    pipe.hget(keys.BATCH_CLAIMS, batch_id)
    claimed = pipe.execute_fenced()[1]
    if claimed is not None and claimed.decode() != intent.id:
        return False
    intent.state, intent.batch_id = SUBMITTED, batch_id
    pipe = FencedTransaction(client)
    pipe.hset(BatchKeys(intent.id).record, mapping={"state": SUBMITTED, "batch_id": batch_id})
    pipe.execute_fenced()
    return True


def claimed(client: redis.Redis, batch_ids: list[str]) -> set[str]:
    if not batch_ids:
        return set()
    found = client.hmget(keys.BATCH_CLAIMS, batch_ids)
    return {b for b, owner in zip(batch_ids, found, strict=True) if owner is not None}


def items(client: redis.Redis, intent_id: str) -> dict[str, Item]:
    raw = client.hgetall(BatchKeys(intent_id).requests)
    return {k.decode(): Item.unpacked(k.decode(), v) for k, v in raw.items()}


def handled(client: redis.Redis, intent_id: str) -> set[str]:
    return {m.decode() for m in client.smembers(BatchKeys(intent_id).handled)}


def mark_handled(client: redis.Redis, intent_id: str, custom_ids: list[str]) -> None:
    if custom_ids:
        client.sadd(BatchKeys(intent_id).handled, *custom_ids)


def update_remote(client: redis.Redis, intent: Intent, batch: dict[str, Any]) -> None:
    counts = batch.get("request_counts") or {}
    intent.remote_status = str(batch.get("status") or "")
    intent.completed, intent.failed = int(counts.get("completed") or 0), int(counts.get("failed") or 0)
    client.hset(BatchKeys(intent.id).record, mapping={"remote_status": intent.remote_status,
                                                      "completed": intent.completed, "failed": intent.failed,
                                                      "polled_s": f"{time.time():.3f}"})


def close(client: redis.Redis, intent: Intent, prompt_ids: list[str], summary: dict[str, Any]) -> None:
    """Every request of the batch has its outcome (or was given back): the batch leaves the open set."""
    k = BatchKeys(intent.id)
    pipe = FencedTransaction(client)
    pipe.hset(k.record, mapping={"state": DONE, "summary": json.dumps(summary)})
    pipe.expire(k.record, DONE_KEEP_S)
    pipe.zrem(keys.BATCHES_OPEN, intent.id)
    if prompt_ids:
        pipe.hdel(DatasetKeys(intent.dataset).batched, *prompt_ids)
    pipe.delete(k.requests, k.handled)
    pipe.execute_fenced()


def take_poll(client: redis.Redis, intent_id: str, owner: str, ttl_ms: int) -> bool:
    """This worker polls the batch until ``ttl_ms`` from now, unless another does."""
    return bool(client.set(BatchKeys(intent_id).poller, owner, nx=True, px=ttl_ms))


def hold_poll(client: redis.Redis, intent_id: str, owner: str, ttl_ms: int) -> bool:
    """Extend this worker's poll of the batch (a long settle); False if another took it."""
    return bool(client.eval(_RELEASE_IF_OURS, 1, BatchKeys(intent_id).poller, owner, ttl_ms))


