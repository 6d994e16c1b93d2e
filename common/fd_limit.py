"""A worker's open-files limit: its soft limit raised to what the host allows, never a refusal to start.

A gevent worker holds one socket per greenlet to the upstream plus its Redis connections, so a soft
limit of 1,024 (a common default) caps it far below ``SPECFLEET_CONCURRENCY``. Asking the engine
for more (compose ``ulimits``) fails outright on a host whose hard limit is lower ("error setting
rlimit"), so the worker raises its own soft limit up to the hard one, which any process may do,
and says what it got; when that is still too low for its pool it warns, naming the knob.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

#: What a worker asks for: the most a worker of the default concurrency could use, with room.
WANTED_OPEN_FILES = 65536
#: Descriptors a worker needs besides one per greenlet: Redis pools, logs, the tokenizer's files.
BASE_OPEN_FILES = 256


def needed_open_files(greenlets: int) -> int:
    """One upstream socket per greenlet, plus the Redis connections a busy pool opens beside them."""
    return 2 * greenlets + BASE_OPEN_FILES


def raise_open_files(greenlets: int, wanted: int = WANTED_OPEN_FILES) -> tuple[int, int]:
    """Raise the soft limit to min(``wanted``, hard) when it is lower; returns (soft, hard) after.

    Inherited across ``exec``, so ``specfleet worker`` calls it before it becomes celery."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("open files: soft limit raised from %d to %d (hard limit %s)", soft, target, _fmt(hard))
        soft = target
    need = needed_open_files(greenlets)
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("open files: %d allowed (hard limit %s), a pool of %d greenlets may need %d: lower "
                    "SPECFLEET_CONCURRENCY or raise the hard limit (compose: `ulimits: nofile` on the worker, "
                    "where the host allows it)", soft, _fmt(hard), greenlets, need)
    return soft, hard


def _fmt(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
