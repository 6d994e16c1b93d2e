"""The producer's seal on a prompt: a worker runs only a message the producer sealed.

A seal is ``HMAC-SHA256(key, dataset NUL id)`` (hex, its first 32 characters), carried in the task
payload (``TaskPayload.seal``). The key is 32 random bytes per dataset, written once (SET NX) at
``DatasetKeys.seal_key`` by the first producer that opens the dataset and kept across runs, so a
message of an earlier run of the same dataset (kombu's unacked restore) is still the producer's.
It replaces a SET of every enqueued id: that grew by one member per prompt of the file, where the
key is 32 bytes whatever the dataset's size. It guards against ids that are not the file's (a
stray or hand-made message), not against someone who can read Redis: such a one could also have
written the SET.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis

from common.keys import DatasetKeys

SEAL_CHARS = 32


def ensure_key(client: redis.Redis, dataset: str) -> bytes:
    """The dataset's seal key, made now when it has none."""
    k = DatasetKeys(dataset).seal_key
    client.set(k, secrets.token_hex(32), nx=True)
    key = client.get(k)
    assert key is not None, k  # just written, or there already
    return bytes(key)


def read_key(client: redis.Redis, dataset: str) -> bytes | None:
    key = client.get(DatasetKeys(dataset).seal_key)
    return None if key is None else bytes(key)


def seal(key: bytes, dataset: str, prompt_id: str) -> str:
    mac = hmac.new(key, f"{dataset}\x00{prompt_id}".encode(), hashlib.sha256).hexdigest()
    return mac[:SEAL_CHARS]


def sealed(key: bytes, dataset: str, prompt_id: str, claimed: object) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(seal(key, dataset, prompt_id), claimed)
