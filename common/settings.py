"""The one settings object: everything specfleet reads from the environment, read in one place.

The run file (``common/config.py``) says *what* to generate; these say *where* and *how hard*.
A bad value fails at start with the variable's name, never deep inside a task.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import ConfigError
from common.redis_url import parse as parse_redis_url

OPENROUTER_DEFAULT_BASE_URL = "https://openrouter.ai"


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: not a whole number") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r}: must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"environment variable {name}={raw!r}: must be <= {maximum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: not a number") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r}: must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    #: None means "no Redis given": the CLI then starts a private Valkey (producer/embedded.py).
    #: A server (``redis://``) or Sentinels (``sentinel://…;sentinel://…?master_name=…``):
    #: common/redis_url.py reads it for every process.
    redis_url: str | None
    #: Kept out of repr so a logged Settings never carries the key.
    openrouter_api_key: str | None = field(repr=False)
    openrouter_base_url: str = OPENROUTER_DEFAULT_BASE_URL
    #: Greenlets per worker process; also the HTTP pool size, so no request waits for a socket.
    worker_concurrency: int = 1000
    #: Must exceed the longest task incl. retries, and be the same in every process (the shortest
    #: wins); redelivery of a SIGKILLed worker's tasks waits this long.
    visibility_timeout_s: int = 7200
    #: How often a worker re-reads which dataset queue is active.
    queue_poll_s: float = 2.0
    #: How often a worker puts unacked messages older than the visibility timeout back in their
    #: queue (kombu does it with gevent only when a poll comes back empty; workers/redelivery.py).
    #: A SIGKILLed worker's tasks come back within visibility_timeout_s + this.
    unacked_restore_s: float = 5.0
    #: How long the producer (every Redis call) and a worker (everything but a settle, which waits
    #: only while its lease lives) keep retrying while Redis is unreachable before giving up.
    redis_retry_window_s: float = 300.0
    #: Where a worker keeps answers it could not settle because Redis was away (workers/spool.py).
    spool_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "specfleet" / "spool")
    metrics_port: int = 9808
    log_level: str = "INFO"
    app_url: str = "https://github.com/specfleet/specfleet"
    app_title: str = "specfleet"
    #: A self-hosted OpenAI-compatible engine (vLLM, SGLang), for runs whose ``model.upstream``
    #: names one: its base URL (``http://host:8000`` or ``…/v1``) and an optional API key.
    engine_url: str | None = None
    engine_api_key: str | None = field(default=None, repr=False)
    #: An answer whose body is larger fails the prompt (``answer_too_large``), billed and counted.
    max_answer_bytes: int = 8 << 20
    #: Bytes of answers a worker rebuilds and settles at once (workers/answer_room.py); an answer
    #: waits for room once its body is in. One larger than all of it goes alone.
    answer_bytes_in_flight: int = 4 << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        base_url = env.get("OPENROUTER_BASE_URL") or OPENROUTER_DEFAULT_BASE_URL
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"environment variable OPENROUTER_BASE_URL={base_url!r}: not an http(s) URL")
        engine_url = env.get("SPECFLEET_ENGINE_URL") or None
        if engine_url and not engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"environment variable SPECFLEET_ENGINE_URL={engine_url!r}: not an http(s) URL")
        redis_url = env.get("REDIS_URL") or None
        if redis_url:
            parse_redis_url(redis_url, "environment variable REDIS_URL")  # a bad one fails here, named
        level = (env.get("SPECFLEET_LOG_LEVEL") or "INFO").upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(f"environment variable SPECFLEET_LOG_LEVEL={level!r}: not a log level")
        return cls(
            redis_url=redis_url,
            openrouter_api_key=env.get("OPENROUTER_API_KEY") or None,
            openrouter_base_url=base_url.rstrip("/"),
            worker_concurrency=_int(env, "SPECFLEET_CONCURRENCY", 1000, minimum=1),
            visibility_timeout_s=_int(env, "SPECFLEET_VISIBILITY_TIMEOUT_S", 7200, minimum=10),
            queue_poll_s=_float(env, "SPECFLEET_QUEUE_POLL_S", 2.0, minimum=0.1),
            unacked_restore_s=_float(env, "SPECFLEET_UNACKED_RESTORE_S", 5.0, minimum=0.1),
            redis_retry_window_s=_float(env, "SPECFLEET_REDIS_RETRY_WINDOW_S", 300.0, minimum=0.0),
            spool_dir=Path(env["SPECFLEET_SPOOL_DIR"]).expanduser() if env.get("SPECFLEET_SPOOL_DIR")
            else Path.home() / ".cache" / "specfleet" / "spool",
            metrics_port=_int(env, "SPECFLEET_METRICS_PORT", 9808, minimum=1, maximum=65535),
            log_level=level,
            app_url=env.get("SPECFLEET_APP_URL") or cls.app_url,
            app_title=env.get("SPECFLEET_APP_TITLE") or cls.app_title,
            engine_url=engine_url.rstrip("/") if engine_url else None,
            engine_api_key=env.get("SPECFLEET_ENGINE_API_KEY") or None,
            max_answer_bytes=_int(env, "SPECFLEET_MAX_ANSWER_BYTES", 8 << 20, minimum=1024),
            answer_bytes_in_flight=_int(env, "SPECFLEET_ANSWER_BYTES_IN_FLIGHT", 4 << 20, minimum=1024),
        )

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ConfigError("environment variable REDIS_URL is not set (e.g. redis://localhost:6379/0)")
        return self.redis_url
