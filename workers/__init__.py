"""specfleet workers: the Celery app lives in workers/celery.py (``celery -A workers``)."""
