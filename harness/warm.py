"""Simulators and workers that outlive one test for the next (``WarmPool``), and the Redis between.

A test's fleet (harness/fleet.py) takes a running simulator or worker from the pool when one was
started alike, and hands its own on when it passed and left them idle: a worker's start is ~2.7 s
of CPU (1.6 of it importing transformers), a simulator's ~0.9, and on the 2-core test box CPU is
what ``make test`` waits on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from common import keys
from harness.zygote import Process


@dataclass
class Warm:
    """A simulator or worker that one test may hand on to the next: its process, its log, its URL."""

    proc: Process
    log: Path
    url: str = ""
    #: a simulator's settings at its start (``sim_settings``), which ``/_sim/reset`` brings back
    settings: dict[str, Any] | None = None
    #: a worker's node name up to its ``@``: its pidbox binding must hold before it is handed on
    node: str = ""
    #: a worker's: the Redis store id (``keys.STORE_ID``) when it was handed on. A test that empties
    #: Redis whole (a restart without persistence: test_fleet, test_budget_fleet…) gives the store a
    #: new id; a parked worker of the old one would take the next test's Redis for another and leave
    #: (workers/fleet/server.py), so it is not handed out again.
    store: bytes | None = None


def kill_group(proc: Process) -> None:
    # Its group: the children too, even once it has ended (Linux hands out no pid still in use as a
    # group's id, so a group whose members are all gone is the only miss).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class WarmPool:
    """Simulators and workers kept from one test to the next (tests/conftest.py ``warm_pool``, for
    the modules that set ``WARM_FLEET``). A test gets a running one when one was started with exactly
    its arguments and a test before handed it on, which it does only when it passed and left the
    fleet idle (``Fleet.stop_all``). In the pool a process is stopped (SIGSTOP); the Redis between
    tests is emptied but for what a worker holds of it (``clean_between_tests``)."""

    def __init__(self, max_idle: int = 8) -> None:
        #: (key, process), the longest idle first; at most ``max_idle`` (a worker holds ~150 MB)
        self._idle: list[tuple[tuple[object, ...], Warm]] = []
        self.max_idle = max_idle

    def take(self, key: tuple[object, ...], store: bytes | None = None) -> Warm | None:
        """A process started as ``key``; a worker only if it was parked on the store ``store``."""
        for i in reversed(range(len(self._idle))):
            if self._idle[i][0] == key:
                warm = self._idle.pop(i)[1]
                if warm.node and warm.store != store:
                    self._end(warm)  # parked on a Redis since emptied whole: it would leave
                    continue
                if warm.proc.poll() is None:
                    warm.proc.send_signal(signal.SIGCONT)
                    return warm
        return None

    def give(self, key: tuple[object, ...], warm: Warm) -> None:
        # Stopped while it waits: a worker in the pool would otherwise take the next tests' tasks
        # (it follows every active queue on the Redis) and send them to its own simulator.
        warm.proc.send_signal(signal.SIGSTOP)
        self._idle.append((key, warm))
        while len(self._idle) > self.max_idle:
            self._end(self._idle.pop(0)[1])

    def close(self) -> None:
        for _, warm in self._idle:
            self._end(warm)
        self._idle.clear()

    @staticmethod
    def _end(warm: Warm) -> None:
        kill_group(warm.proc)
        warm.proc.wait()


def kept_between_tests(key: bytes) -> bool:
    return key == keys.STORE_ID.encode() or key.startswith(b"_kombu.binding")


def clean_between_tests(client: redis.Redis) -> None:
    """Every key but the two a warm worker keeps across tests: the store's id (a worker that served a
    run leaves a store whose id changed, workers/fleet/server.py) and kombu's bindings (the
    broadcast and event exchanges a worker declared once at its start, which Flower and ``celery
    inspect`` need)."""
    doomed = [k for k in client.scan_iter(count=1000) if not kept_between_tests(k)]
    for start in range(0, len(doomed), 1000):
        client.delete(*doomed[start:start + 1000])


#: Settings a running simulator cannot take from a test as they were given at its start: fixed ones,
#: the merged maps (``/_sim/config`` merges ``rates`` key by key, so one cannot be taken away) and the
#: keys it expects (``/_sim/config`` reads them back masked).
_SIM_KEPT = ("rates", "length_classes", "expect_key", "management_key")


def sim_settings(args: Sequence[str], tokenizer: Path) -> tuple[tuple[object, ...], dict[str, Any]]:
    """A simulator's launch ``args`` (``tokenizer`` unless they name one) as (what a pooled one must
    have been started with alike, the settings ``/_sim/config`` gives it for the rest)."""
    from simulator.__main__ import settings_from_args
    from simulator.settings import settings_fields

    parsed = settings_from_args(["--tokenizer", str(tokenizer), *args])[0]
    settings = parsed.to_json()
    # to_json masks the keys ("<set>"): two simulators expecting different keys must not look alike
    # (the account test once got one started with the throttle test's management key, and its 403).
    for name in ("expect_key", "management_key"):
        if (secret := getattr(parsed, name)) is not None:
            settings[name] = hashlib.sha256(secret.encode()).hexdigest()
    same = {f.name for f, _ in settings_fields() if f.metadata["fixed"] or f.name in _SIM_KEPT} - {"port"}
    key = ("simulator", json.dumps({n: v for n, v in settings.items() if n in same}, sort_keys=True))
    return key, {n: v for n, v in settings.items() if n not in same and n != "port"}
