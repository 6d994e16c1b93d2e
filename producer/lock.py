"""One producer per Redis: a lease refreshed while the run lives, with a fencing token.

The key expires LOCK_TTL_S after the last refresh, as an absolute time (AOF keeps it so), so a
Redis that restarts within the TTL still holds it for us. A lease alone cannot stop a holder that
was paused (SIGSTOP, a VM pause) past its TTL from writing once it resumes: so every acquire or
take-over bumps a generation, and the token ``<generation>|<host>:<pid>`` is stored both in the
lock and, without expiry, in ``PRODUCER_GENERATION`` (the last producer that took it). A write
that depends on holding the lock goes through ``write``: one script checks the token where the
write lands. A lock that expired is taken again only if no other producer took a newer generation
meanwhile; otherwise this producer is fenced (``ProducerFenced``) and must not write again. The
output folder checks the generation too (``producer/rows.py``): its checkpoint records the
generation that wrote it, and a writer of an older one is refused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from common.errors import ConfigError, ProducerFenced
from common.keys import PRODUCER_GENERATION, PRODUCER_LOCK
from producer.refusals import WriteHold

log = logging.getLogger(__name__)

LOCK_TTL_S = 10


# KEYS[1] lock, KEYS[2] generation; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] lowest generation to
# take (the output folder's), ARGV[4] the holder we may replace ("" only a free lock)
# -> {1, token} | {0, holder}
_ACQUIRE = """
local holder = redis.call("GET", KEYS[1])
if holder and holder ~= ARGV[4] then return {0, holder} end
local last = redis.call("GET", KEYS[2])
local gen = tonumber(last and string.match(last, "^(%d+)|") or "0")
gen = math.max(gen, tonumber(ARGV[3])) + 1
local token = string.format("%d", gen) .. "|" .. ARGV[1]
redis.call("SET", KEYS[2], token)
redis.call("SET", KEYS[1], token, "PX", ARGV[2])
return {1, token}
"""

# KEYS[1] lock, KEYS[2] generation; ARGV[1] token, ARGV[2] ttl ms, ARGV[3] "refresh" | "write",
# then for "write" the commands: <argc> <name> <arg>... each.
# -> {"fenced", holder or newer token} | {"ours" | "taken", reply...}
# The check reads only, so the first write is the caller's own command: under maxmemory a refused
# command refuses the whole script before anything was written (a script that has written is let
# through by Redis), and retrying it whole is safe.
_FENCED = """
local holder = redis.call("GET", KEYS[1])
local status = "ours"
if holder ~= ARGV[1] then
  if holder then return {"fenced", holder} end
  local last = redis.call("GET", KEYS[2])
  if last and last ~= ARGV[1] then return {"fenced", last} end
  status = "taken"
end
local replies = {status}
local i = 4
while i <= #ARGV do
  local argc = tonumber(ARGV[i])
  local reply = redis.call(unpack(ARGV, i + 1, i + argc))
  if type(reply) == "table" and reply.ok then reply = reply.ok end
  replies[#replies + 1] = reply
  i = i + argc + 1
end
if status == "taken" then
  redis.call("SET", KEYS[2], ARGV[1])
  redis.call("SET", KEYS[1], ARGV[1], "PX", ARGV[2])
elseif ARGV[3] == "refresh" then
  redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return replies
"""
# KEYS[1] lock; ARGV[1] token -> 1 if it was ours and is deleted
_RELEASE = """
if redis.call("GET", KEYS[1]) == ARGV[1] then return redis.call("DEL", KEYS[1]) end
return 0
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parse_token(token: str) -> tuple[int, str]:
    """(generation, ``host:pid``) of a lock value; a lock of an older specfleet is generation 0."""
    gen, sep, owner = token.partition("|")
    return (int(gen), owner) if sep and gen.isdigit() else (0, token)


class ProducerLock:
    def __init__(self, client: redis.Redis, hold: WriteHold | None = None) -> None:
        """``hold``: waits out a Redis that refuses writes (``producer/refusals.py``)."""
        self._client = client
        self._hold = hold
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.token = ""
        #: Monotonic time of the last answer that proved the lock ours.
        self.confirmed_s = 0.0
        self._acquire = client.register_script(_ACQUIRE)
        self._fenced = client.register_script(_FENCED)
        self._release = client.register_script(_RELEASE)

    def acquire(self, floor_generation: int = 0) -> None:
        """Take the lock with a generation above every earlier one and above ``floor_generation``
        (the output folder's: a Redis that lost the counter must not hand out an old one again)."""
        replace = ""
        for _ in range(2):
            ok, value = self._held(functools.partial(self._acquire, keys=[PRODUCER_LOCK, PRODUCER_GENERATION],
                                                     args=[self.owner, LOCK_TTL_S * 1000, floor_generation, replace]))
            value = value.decode() if isinstance(value, bytes) else str(value)
            if int(ok):
                self.token = value
                self.confirmed_s = time.monotonic()
                log.info("producer lock taken (generation %d)", self.generation)
                return
            host, _, pid = parse_token(value)[1].rpartition(":")
            # A producer on this host that was SIGKILLed need not block a resume for LOCK_TTL_S.
            if replace or not (host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))):
                break
            replace = value
        raise ConfigError(
            f"another producer ({value}) is running against this Redis; "
            f"stop it or wait {LOCK_TTL_S} s after it died"
        )

    @property
    def generation(self) -> int:
        """The generation in ``token`` (0 before the lock is taken)."""
        return parse_token(self.token)[0]

    def _call(self, mode: str, commands: Sequence[Sequence[Any]]) -> list[Any]:
        args: list[Any] = [self.token, LOCK_TTL_S * 1000, mode]
        for command in commands:
            args += [len(command), *command]
        reply = self._held(lambda: self._fenced(keys=[PRODUCER_LOCK, PRODUCER_GENERATION], args=args))
        status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if status == "fenced":
            holder = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            gen, owner = parse_token(holder)
            raise ProducerFenced(
                f"another producer ({owner}, generation {gen}) took over this Redis while this one "
                f"(generation {self.generation}) was paused or cut off; this one wrote nothing more and stops: "
                "let that one finish, or run the same command again once it has")
        if status == "taken":
            log.warning("the producer lock was gone from Redis (restarted, or away longer than %d s) and no "
                        "other producer took it: taken again (generation %d)", LOCK_TTL_S, self.generation)
        self.confirmed_s = time.monotonic()
        return list(reply[1:])

    def _held(self, call: Callable[[], Any]) -> Any:
        return call() if self._hold is None else self._hold(call)

    def refresh(self) -> None:
        """Extend the lease; ``ProducerFenced`` if another producer holds it or took a newer generation."""
        self._call("refresh", ())

    def refresh_if_older(self, age_s: float) -> None:
        """Refresh when the lock was last proved ours more than ``age_s`` ago (a pause, an outage)."""
        if time.monotonic() - self.confirmed_s > age_s:
            self.refresh()

    def write(self, *commands: Sequence[Any]) -> list[Any]:
        """Run ``commands`` (each a command name and its arguments) only while the lock is ours,
        atomically with the check; returns their replies. ``ProducerFenced`` otherwise."""
        return self._call("write", commands)

    def release(self) -> None:
        """Best effort: on the way out after an outage Redis may still be away; the TTL ends it."""
        with contextlib.suppress(redis.RedisError):
            self._release(keys=[PRODUCER_LOCK], args=[self.token])
