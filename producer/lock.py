"""One producer per Redis: a lease refreshed while the run lives, taken over when its owner died."""

from __future__ import annotations

import os
import socket

import redis

from common.errors import ConfigError
from common.keys import PRODUCER_LOCK

LOCK_TTL_S = 10


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
        self._client.set(PRODUCER_LOCK, self.owner, ex=LOCK_TTL_S)

    def release(self) -> None:
        if (self._client.get(PRODUCER_LOCK) or b"").decode() == self.owner:
            self._client.delete(PRODUCER_LOCK)
