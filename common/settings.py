"""The one settings object: everything specfleet reads from the environment, read in one place.

The run file (``common/config.py``) says *what* to generate; these say *where* and *how hard*.
A bad value fails at start with the variable's name, never deep inside a task. Each field says
once, on itself, its default, its variable and its bounds (``_env``); ``from_env`` reads them all.
pydantic-settings would do the same with a new dependency and its own wording of errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from common.endpoints import Endpoints
from common.errors import ConfigError
from common.redis_url import parse as parse_redis_url

OPENROUTER_DEFAULT_BASE_URL = "https://openrouter.ai"


def _whole(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: not a whole number") from None


def _number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r}: not a number") from None


def _http_url(name: str, raw: str) -> str:
    if not raw.startswith(("http://", "https://")):
        raise ConfigError(f"environment variable {name}={raw!r}: not an http(s) URL")
    try:
        Endpoints.of(raw)  # the routes are derived where used; a URL that has none fails here, named
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}: {exc}") from None
    return raw.rstrip("/")


def _redis_url(name: str, raw: str) -> str:
    parse_redis_url(raw, f"environment variable {name}")  # a bad one fails here, named
    return raw


def _log_level(name: str, raw: str) -> str:
    level = raw.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"environment variable {name}={level!r}: not a log level")
    return level


def _text(_name: str, raw: str) -> str:
    return raw


def _folder(_name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _env(variable: str, parse: Callable[[str, str], Any] = _text, *, minimum: float | None = None,
         maximum: float | None = None) -> dict[str, Any]:
    """A field's variable and how its value is read: unset or empty gives the field's default."""
    return {"env": variable, "parse": parse, "minimum": minimum, "maximum": maximum}


def _spool_dir() -> Path:
    return Path.home() / ".cache" / "specfleet" / "spool"


def _tokenizer_cache_dir() -> Path:
    return Path.home() / ".cache" / "specfleet" / "tokenizers"


def _tokenizer_from(name: str, raw: str) -> str:
    if raw not in {"redis", "local"}:
        raise ConfigError(f"environment variable {name}={raw!r}: must be redis or local")
    return raw


@dataclass(frozen=True)
class Settings:
    #: None means "no Redis given": the CLI then starts a private Valkey (producer/embedded.py).
    #: A server (``redis://``) or Sentinels (``sentinel://…;sentinel://…?master_name=…``):
    #: common/redis_url.py reads it for every process.
    redis_url: str | None = field(default=None, metadata=_env("REDIS_URL", _redis_url))
    #: Kept out of repr so a logged Settings never carries the key.
    openrouter_api_key: str | None = field(default=None, repr=False, metadata=_env("OPENROUTER_API_KEY"))
    openrouter_base_url: str = field(default=OPENROUTER_DEFAULT_BASE_URL,
                                     metadata=_env("OPENROUTER_BASE_URL", _http_url))
    #: Greenlets per worker process; also the HTTP pool size, so no request waits for a socket.
    worker_concurrency: int = field(default=1000, metadata=_env("SPECFLEET_CONCURRENCY", _whole, minimum=1))
    #: Must exceed the longest task incl. retries, and be the same in every process (the shortest
    #: wins); redelivery of a SIGKILLed worker's tasks waits this long.
    visibility_timeout_s: int = field(default=7200, metadata=_env("SPECFLEET_VISIBILITY_TIMEOUT_S", _whole,
                                                                  minimum=10))
    #: How often a worker re-reads which dataset queue is active.
    queue_poll_s: float = field(default=2.0, metadata=_env("SPECFLEET_QUEUE_POLL_S", _number, minimum=0.1))
    #: How often a worker puts unacked messages older than the visibility timeout back in their
    #: queue (kombu does it with gevent only when a poll comes back empty; workers/fleet/recovery.py).
    #: A SIGKILLed worker's tasks come back within visibility_timeout_s + this.
    unacked_restore_s: float = field(default=5.0, metadata=_env("SPECFLEET_UNACKED_RESTORE_S", _number,
                                                                minimum=0.1))
    #: How long the producer (every Redis call) and a worker (everything but a settle, which waits
    #: only while its lease lives) keep retrying while Redis is unreachable before giving up.
    redis_retry_window_s: float = field(default=300.0, metadata=_env("SPECFLEET_REDIS_RETRY_WINDOW_S", _number,
                                                                     minimum=0.0))
    #: Where a worker keeps answers it could not settle because Redis was away (workers/fleet/spool.py).
    spool_dir: Path = field(default_factory=_spool_dir, metadata=_env("SPECFLEET_SPOOL_DIR", _folder))
    metrics_port: int = field(default=9808, metadata=_env("SPECFLEET_METRICS_PORT", _whole, minimum=1,
                                                          maximum=65535))
    log_level: str = field(default="INFO", metadata=_env("SPECFLEET_LOG_LEVEL", _log_level))
    app_url: str = field(default="https://github.com/specfleet/specfleet", metadata=_env("SPECFLEET_APP_URL"))
    app_title: str = field(default="specfleet", metadata=_env("SPECFLEET_APP_TITLE"))
    #: A self-hosted OpenAI-compatible engine (vLLM, SGLang), for runs whose ``model.upstream``
    #: names one: its base URL (``http://host:8000`` or ``…/v1``) and an optional API key.
    engine_url: str | None = field(default=None, metadata=_env("SPECFLEET_ENGINE_URL", _http_url))
    engine_api_key: str | None = field(default=None, repr=False, metadata=_env("SPECFLEET_ENGINE_API_KEY"))
    #: An answer whose body is larger fails the prompt (``answer_too_large``), billed and counted.
    max_answer_bytes: int = field(default=8 << 20, metadata=_env("SPECFLEET_MAX_ANSWER_BYTES", _whole,
                                                                 minimum=1024))
    #: Bytes of answers a worker rebuilds and settles at once (workers/fleet/answer_room.py); an answer
    #: waits for room once its body is in. One larger than all of it goes alone.
    answer_bytes_in_flight: int = field(default=4 << 20, metadata=_env("SPECFLEET_ANSWER_BYTES_IN_FLIGHT", _whole,
                                                                       minimum=1024))
    #: The producer's queue window (producer/window.py): a dataset's queue holds at most this many
    #: prompts, and at most this many bytes of their messages; refilled as workers take them. Redis
    #: then holds a window, not the dataset. Defaults: 4x a 2,000-in-flight fleet's share, and 64 MiB.
    queue_window_prompts: int = field(default=8_000, metadata=_env("SPECFLEET_QUEUE_WINDOW_PROMPTS", _whole,
                                                                   minimum=1))
    queue_window_bytes: int = field(default=64 << 20, metadata=_env("SPECFLEET_QUEUE_WINDOW_BYTES", _whole,
                                                                    minimum=1 << 16))

    #: Where a worker keeps the run tokenizers the producer hands over through Redis, one folder per
    #: pin (common/tokenizer_pin.py): written once per host, read by every worker process on it.
    tokenizer_cache_dir: Path = field(default_factory=_tokenizer_cache_dir,
                                      metadata=_env("SPECFLEET_TOKENIZER_CACHE_DIR", _folder))
    #: ``redis``: load the run's tokenizer from the files the producer put in Redis (this host's path
    #: to it does not matter); ``local``: from ``[model] tokenizer`` as this host sees it. Either way
    #: the files must be the run manifest's, or the worker refuses the run.
    tokenizer_from: str = field(default="redis", metadata=_env("SPECFLEET_TOKENIZER_FROM", _tokenizer_from))

    #: Batch mode: how long a worker waits for ``POST /api/v1/batches`` to answer (a batch uploads up
    #: to 200 MB). A POST without an answer may still have created its batch: it is looked for, never
    #: posted again blindly, once 1.5x this has passed (workers/pipeline/batch/poll.py).
    batch_submit_timeout_s: float = field(default=120.0, metadata=_env("SPECFLEET_BATCH_SUBMIT_TIMEOUT_S", _number,
                                                                       minimum=1.0))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Each field from its variable (``_env`` on the field); unset or empty: the default."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            name, raw = f.metadata["env"], env.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            value = f.metadata["parse"](name, raw)
            low, high = f.metadata["minimum"], f.metadata["maximum"]
            if low is not None and value < low:
                raise ConfigError(f"environment variable {name}={raw!r}: must be >= {low}")
            if high is not None and value > high:
                raise ConfigError(f"environment variable {name}={raw!r}: must be <= {high}")
            values[f.name] = value
        return cls(**values)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values every log line and dead letter must not carry (the API keys that are set)."""
        return tuple(s for s in (self.openrouter_api_key, self.engine_api_key) if s)

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ConfigError("environment variable REDIS_URL is not set (e.g. redis://localhost:6379/0)")
        return self.redis_url
