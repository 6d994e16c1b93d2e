"""The one worker command line: what ``specfleet worker``, ``specfleet demo`` and the tests start.

    python -m celery -A workers worker -P gevent -c pool_size(N) -Q specfleet.idle -E -n specfleet@%h
        --without-mingle --without-gossip [extra…]

``N`` (``SPECFLEET_CONCURRENCY``) is the process's upstream requests in flight; its pool has a
quarter more greenlets, for the tasks between their requests and Redis (``workers/fleet/gate.py``).

The node name is stable (``specfleet@%h``), so a restarted worker is the same worker in Flower and
``celery inspect``; several on one host are ``specfleet-1@%h``, ``specfleet-2@%h``…. A ``-n`` /
``--hostname`` in ``extra`` (the user's) wins over ours.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from common.contract import IDLE_QUEUE

NODE_PREFIX = "specfleet"


def node_name(index: int | None = None) -> str:
    """``specfleet@%h``, or ``specfleet-<index>@%h`` for the index-th of several on one host."""
    return f"{NODE_PREFIX}@%h" if index is None else f"{NODE_PREFIX}-{index}@%h"


def _names_node(extra: Sequence[str]) -> bool:
    """True when the user's arguments name the node: ``-n X``, ``-nX``, ``--hostname[=]X``."""
    return any(a.startswith(("-n", "--hostname")) for a in extra)


def pool_size(concurrency: int) -> int:
    """Greenlets of a worker that holds ``concurrency`` upstream requests in flight: each task also
    waits about a second for its reserve and its settle to reach the AOF (two fences), and at
    15 s latency that second is 7% of a round, so a quarter more covers it down to ~4 s latency
    (shorter latencies are bound by CPU, not by greenlets)."""
    return concurrency + max(1, concurrency // 4)


def worker_argv(concurrency: int, *, index: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """argv of one gevent worker with ``concurrency`` requests in flight (run it with the settings'
    env, whose ``SPECFLEET_CONCURRENCY`` must say the same)."""
    argv = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-P", "gevent",
            "-c", str(pool_size(concurrency)), "-Q", IDLE_QUEUE, "-E"]
    if not _names_node(extra):
        argv += ["-n", node_name(index)]
    # Mingle and gossip cost a broadcast round per start and per event; workers learn the run from Redis.
    return [*argv, "--without-mingle", "--without-gossip", *extra]
