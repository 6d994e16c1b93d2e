"""specfleet workers: the Celery app lives in workers/celery.py (``celery -A workers``); every patch
of another library's private code in workers/runtime/, installed from there."""

import os
import socket

#: This worker process in what it writes to Redis (a halt, a dead letter, the write probe).
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
