"""One producer per Redis: a lease refreshed while the run lives, taken over when its owner died.

The key expires LOCK_TTL_S after the last refresh, as an absolute time (AOF keeps it so), so a
Redis that restarts within the TTL still holds it for us. A refresh that finds the key gone (Redis
lost it, or the outage outlived the TTL) takes it again only if nobody else has; a refresh that
finds another owner stops this producer: two producers on one Redis would enqueue everything twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import redis

from common.errors import ConfigError, SpecfleetError
from common.keys import PRODUCER_LOCK

log = logging.getLogger(__name__)

LOCK_TTL_S = 10

# KEYS[1] lock; ARGV[1] owner, ARGV[2] ttl ms -> "ours" (extended) | "taken" (was gone, set) | holder
_REFRESH = """
local holder = redis.call("GET", KEYS[1])
if holder == ARGV[1] then
  redis.call("PEXPIRE", KEYS[1], ARGV[2])
  return "ours"
end
if not holder then
  redis.call("SET", KEYS[1], ARGV[1], "PX", ARGV[2])
  return "taken"
end
return holder
"""
# KEYS[1] lock; ARGV[1] owner -> 1 if it was ours and is deleted
_RELEASE = """
if redis.call("GET", KEYS[1]) == ARGV[1] then return redis.call("DEL", KEYS[1]) end
return 0
"""


class LockLost(SpecfleetError):
    """Another producer took the lock while this one could not reach Redis."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProducerLock:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._refresh = client.register_script(_REFRESH)
        self._release = client.register_script(_RELEASE)

    def acquire(self) -> None:
        if self._client.set(PRODUCER_LOCK, self.owner, nx=True, ex=LOCK_TTL_S):
            return
        holder = (self._client.get(PRODUCER_LOCK) or b"").decode()
        host, _, pid = holder.rpartition(":")
        # A producer on this host that was SIGKILLed need not block a resume for LOCK_TTL_S.
        if host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid)):
            self._client.set(PRODUCER_LOCK, self.owner, ex=LOCK_TTL_S)
            return
        raise ConfigError(
            f"another producer ({holder}) is running against this Redis; "
            f"stop it or wait {LOCK_TTL_S} s after it died"
        )

    def refresh(self) -> None:
        answer = self._refresh(keys=[PRODUCER_LOCK], args=[self.owner, LOCK_TTL_S * 1000])
        answer = answer.decode() if isinstance(answer, bytes) else str(answer)
        if answer == "taken":
            log.warning("the producer lock was gone from Redis (restarted, or away longer than %d s): taken again",
                        LOCK_TTL_S)
        elif answer != "ours":
            raise LockLost(f"another producer ({answer}) took the lock while Redis was unreachable; "
                           "this one stops so the two do not enqueue the same prompts")

    def release(self) -> None:
        """Best effort: on the way out after an outage Redis may still be away; the TTL ends it."""
        with contextlib.suppress(redis.RedisError):
            self._release(keys=[PRODUCER_LOCK], args=[self.owner])
