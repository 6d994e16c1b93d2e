"""specfleet workers. ``celery -A workers`` finds the Celery app in ``workers/celery.py``; a worker
process starts in ``workers/bootstrap.py`` (``boot``).

- ``pipeline/``: one task's work, message to kept row (prepare, reserve, call, rebuild, settle);
- ``upstreams/``: who answers (OpenRouter, a vLLM/SGLang engine, the in-process fake);
- ``fleet/``: the process in its fleet (queues, throttle, flow control, spool, recovery, stop);
- ``runtime/``: every patch of another library's private code, fenced, installed from one place.
"""

import os
import socket

#: This worker process in what it writes to Redis (a halt, a dead letter, the write probe).
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
