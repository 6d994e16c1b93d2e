"""At a run's start: whether any worker answers, said in one line (a run without workers waits)."""

from __future__ import annotations

import logging
import threading

from celery import Celery

log = logging.getLogger(__name__)


def warn_if_no_workers(app: Celery) -> None:
    # A broadcast ping waits its whole timeout for replies: in a thread, so the first prompt is
    # queued at once instead of a second later.
    threading.Thread(target=_ping_workers, args=(app,), name="ping", daemon=True).start()


def _ping_workers(app: Celery) -> None:
    try:
        # A connection of its own: on the pooled one the run's enqueue also uses, the wait for
        # replies lasted until the run ended (seen in `specfleet demo`: the warning came last).
        with app.connection_for_write() as conn:
            replies = app.control.ping(timeout=1.0, connection=conn)
    except Exception:  # control needs the broker only; a failure here is not fatal
        replies = []
    if not replies:
        log.warning("no worker answered a ping: start some with `specfleet worker` (same REDIS_URL)")
    else:
        log.info("%d worker(s) online", len(replies))
