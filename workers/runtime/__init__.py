"""Every change specfleet makes to other libraries' private code, in one place, fenced.

``PATCHES`` lists them (common/runtime.py's ``Patch``: target, reason, upstream issue, the version
verified and its source fingerprint). ``install`` checks every fingerprint before it patches
anything: the worker runs on the patched libraries exactly as verified, or refuses to start with
one line (``refuse``) naming the package, its version and the patch. Called once, from
workers/bootstrap.py's ``boot`` (on Celery's ``celeryd_init``: after ``-P gevent`` patched the
standard library, before kombu or Celery consume anything).

| module          | library | what                                                        |
|-----------------|---------|-------------------------------------------------------------|
| kombu_redis     | kombu   | twelve methods of the Redis transport                       |
| kombu_sleep     | kombu   | ``retry_over_time``'s ``sleep`` bound before gevent patched |
| dns             | gevent  | ``socket.getaddrinfo`` shared and kept for ``TTL_S``        |
| urllib3_pool    | urllib3 | the pool internals ``OpenRouterClient.warm`` relies on      |
| celery_pidbox   | celery  | the remote-control loop reconnects after a broker failover  |
| common.runtime  | redis   | ``get_lib_version`` cached; the Sentinel connection override |
"""

from __future__ import annotations

import sys
from typing import NoReturn

from common import runtime as common_runtime
from common.errors import PatchDrift
from common.runtime import Patch, check
from workers.fleet.send_room import SendRoom
from workers.runtime import celery_pidbox, dns, kombu_redis, kombu_sleep, urllib3_pool

PATCHES: tuple[Patch, ...] = (*common_runtime.PATCHES, *kombu_redis.PATCHES, *kombu_sleep.PATCHES, *dns.PATCHES,
                              *urllib3_pool.PATCHES, *celery_pidbox.PATCHES)

#: A worker refusing a library nobody verified exits with this (common/errors.py's table).
EXIT_PATCH_DRIFT = PatchDrift.exit_code


def install(room: SendRoom | None = None, admit: kombu_redis.Admit | None = None) -> None:
    """Check every patch, then install them all (again: nothing more). Raises ``PatchDrift``."""
    check(PATCHES)
    common_runtime.install()
    kombu_sleep.install()
    kombu_redis.install(room, admit=admit)
    dns.install()
    urllib3_pool.install()
    celery_pidbox.install()


def refuse(exc: PatchDrift) -> NoReturn:
    """The worker's one line, and its exit before Celery starts consuming."""
    sys.stderr.write(f"specfleet worker: refusing to start: {exc}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_PATCH_DRIFT)  # from the worker's boot: Celery ends with this code, no traceback
