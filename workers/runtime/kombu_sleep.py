"""kombu's ``retry_over_time`` sleeps through gevent, not around it (fenced: ``PATCHES``)."""

from __future__ import annotations

import time

import kombu.utils.functional

from common.runtime import Patch, check

PATCHES = (
    Patch(target="kombu.utils.functional:retry_over_time", dist="kombu", verified="5.7.0",
          fingerprint="e42bfc8a734b8e7b373488d9d63b862cfb3eece27008193064ccf7440ce59721",
          why="its reconnect waits sleep through gevent, not the whole hub",
          # Seen, and checked, by tests/test_hub_reconnect.py.
          reason="Celery's -P gevent patches time only after kombu.utils.functional took 'from time import sleep': "
                 "retry_over_time (Celery's broker reconnect: 2 s, 4 s, 6 s…) held the whole hub for every wait, "
                 "and attempts in flight passed their deadline with their answers already in. The module's sleep "
                 "is rebound to the (patched) time.sleep; outside gevent it is the same function.",
          upstream="none filed", replacement="kombu.utils.functional:sleep = time.sleep"),
)


def install() -> None:
    check(PATCHES)
    kombu.utils.functional.sleep = time.sleep
