"""Which Redis servers specfleet runs on, and the refusal of one below the minimum.

The minimum is what the code sends, not a policy: ``SMISMEMBER`` (producer/admission.py) and
``XTRIM … MINID`` (producer/collector.py) are Redis 6.2 commands; every Valkey release (7.2 on)
has them. ``WAITAOF`` (Redis 7.2, every Valkey) is optional: the fence (common/redis_client.py)
goes on without it on 6.2 and 7.0. The version is read from ``INFO server``, which managed
services answer (``CONFIG`` is often renamed or forbidden there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from common.errors import RedisTooOld

#: The oldest Redis with every command specfleet sends (SMISMEMBER, XTRIM MINID).
MIN_REDIS = (6, 2)
#: Valkey's first release; it reports ``redis_version`` 7.2.4 beside its own ``valkey_version``.
MIN_VALKEY = (7, 2)


def supported() -> str:
    """The sentence the refusal says (and the README): "Redis >= 6.2 or Valkey >= 7.2"."""
    return f"Redis >= {'.'.join(map(str, MIN_REDIS))} or Valkey >= {'.'.join(map(str, MIN_VALKEY))}"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit())  # "7.2.0-rc1", "255.255.255" (unstable)
        parts.append(int(digits or 0))
    return tuple(parts)


@dataclass(frozen=True)
class Server:
    """A server as ``INFO server`` describes it."""

    name: str  # "Redis" or "Valkey"
    version: tuple[int, ...]

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Server:
        valkey = info.get("valkey_version")
        if valkey is not None:
            return cls("Valkey", _version(str(valkey)))
        return cls("Redis", _version(str(info.get("redis_version", "0"))))

    @property
    def supported(self) -> bool:
        return self.version[:2] >= (MIN_VALKEY if self.name == "Valkey" else MIN_REDIS)

    def __str__(self) -> str:
        return f"{self.name} {'.'.join(map(str, self.version))}"


def server_of(client: redis.Redis) -> Server:
    return Server.from_info(client.info("server"))


def require_supported(client: redis.Redis) -> Server:
    """The server ``client`` talks to, or ``RedisTooOld`` naming its version and the minimum."""
    server = server_of(client)
    if not server.supported:
        raise RedisTooOld(str(server), supported())
    return server
