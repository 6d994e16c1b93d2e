"""Celery settings both sides must agree on (a mismatch, e.g. in visibility_timeout, loses tasks)."""

from __future__ import annotations

from typing import Any

from common.contract import IDLE_QUEUE
from common.redis_url import parse as parse_redis_url
from common.settings import Settings


def celery_config(settings: Settings, redis_url: str) -> dict[str, Any]:
    # A Sentinel URL becomes kombu's own form: the sentinel:// list, and the master's name (and the
    # Sentinels' password) in the transport options; Flower's broker view reads the same two.
    target = parse_redis_url(redis_url)
    return {
        "broker_url": target.broker_url(),
        # Rows travel through our own Redis stream (budget.lua): no result backend to fill up.
        "result_backend": None,
        "task_ignore_result": True,
        # msgpack only: never accept pickle from a queue anybody with Redis access can write to.
        "task_serializer": "msgpack",
        "accept_content": ["msgpack"],
        "event_serializer": "json",
        # A task killed mid-flight is delivered again; the budget script makes that harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # With acks_late, one reserved message per greenlet: no worker hoards a dataset's queue.
        "worker_prefetch_multiplier": 1,
        # Cancelling running tasks on a broker blip throws away requests already paid for, and their
        # redelivered copies pay again; ours finish, and budget.lua makes a second finish harmless.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # kombu's Redis channel allows 10 connections and raises past that; every greenlet
            # acks on its own, and one "Too many connections" restarts the consumer, which
            # redelivers everything unacked.
            "max_connections": settings.worker_concurrency + 100,
            # Fail over quickly when Redis blips instead of hanging a greenlet forever.
            "socket_timeout": 30,
            "socket_connect_timeout": 10,
            "health_check_interval": 25,
            # workers/fleet/recovery.py restores unacked messages on a timer under this mutex; a worker
            # SIGKILLed while holding it must not stop every restore for kombu's default 5 minutes.
            "unacked_mutex_expire": 30,
            **target.transport_options(),
        },
        "broker_connection_retry_on_startup": True,
        "broker_pool_limit": 50,
        "task_default_queue": IDLE_QUEUE,
        "task_create_missing_queues": True,
        # Flower needs events; they are cheap next to an LLM call.
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
    }
