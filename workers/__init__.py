"""specfleet workers: the Celery app lives in workers/celery.py (``celery -A workers``)."""

import time

import kombu.utils.functional

# Celery's `-P gevent` patches `time` only after kombu.utils.functional took `from time import
# sleep`: its retry_over_time, Celery's broker reconnect, then held the whole hub for every wait
# (2 s, 4 s, 6 s…), so a Redis restart let attempts in flight pass their deadline with their
# answers already in (tests/test_hub_reconnect.py). Outside gevent this is the same function.
kombu.utils.functional.sleep = time.sleep
