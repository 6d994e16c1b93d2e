"""specfleet workers: the Celery app lives in workers/celery.py (``celery -A workers``); every patch
of another library's private code in workers/runtime/, installed from there."""
