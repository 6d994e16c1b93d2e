"""A worker's broker reconnect must not stop its gevent hub.

Celery's ``-P gevent`` patches ``time`` after ``kombu.utils.functional`` has taken ``from time
import sleep``: its ``retry_over_time``, which Celery's consumer runs to reconnect to the broker
(2 s, 4 s, 6 s… between tries), then held the whole process. In the chaos soak a Redis SIGKILL
froze every greenlet of a worker for 6 s: attempts whose answers had arrived passed their deadline
(``timeout``), were thrown away and asked again (paid twice). The process is started as
``python -m celery -A workers worker -P gevent`` starts it: the patch first, then the app and its
task, then workers/bootstrap.py's ``boot`` (whose ``workers.runtime.install`` rebinds kombu's ``sleep``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fleet import REPO

SCRIPT = """
import sys
sys.argv = ["celery", "-A", "workers", "worker", "-P", "gevent"]
from celery import maybe_patch_concurrency
maybe_patch_concurrency()
from workers.celery import app  # what -A workers loads (it installs nothing)
import workers.pipeline.task  # the app's include, imported before the worker boots
from workers.bootstrap import boot
boot(app.settings, app)  # what the worker's celeryd_init runs: it installs workers/runtime/'s patches
import time, gevent
from kombu.utils.functional import retry_over_time
ticks = []
def ticker():
    while True:
        ticks.append(time.monotonic())
        gevent.sleep(0.05)
gevent.spawn(ticker)
gevent.sleep(0.2)
def down():
    raise ConnectionError("broker down")
t = time.monotonic()
try:
    retry_over_time(down, (ConnectionError,), max_retries=1, interval_start=1, interval_max=1)
except ConnectionError:
    pass
print(sum(1 for x in ticks if x > t))
"""


def test_the_broker_reconnect_lets_other_greenlets_run() -> None:
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"}  # the app is built, never connects
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    ticks = int(out.stdout.split()[-1])
    # 1 s of reconnect wait at a tick every 0.05 s: ~20 ticks when the hub runs, 0 when it is held.
    assert ticks >= 5, f"the hub was held for the reconnect's wait ({ticks} ticks of ~20)"
