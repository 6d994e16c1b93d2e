"""Per-process state of a worker: settings, Redis, the HTTP client, run configs, tokenizers.

Built lazily on first use, after Celery's gevent patching, and shared by all greenlets.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis

from common import keys
from common.errors import ConfigError, TokenizerError
from common.redis_client import UNREACHABLE, WindowRetry
from common.settings import Settings
from workers.openrouter import OpenRouterClient
from workers.target import TargetTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunView:
    """A worker's view of a run config (``RunConfig.worker_view`` as stored by the producer)."""

    config_id: str
    raw: dict[str, Any]

    @property
    def model(self) -> dict[str, Any]:
        return self.raw["model"]

    @property
    def request_body(self) -> dict[str, Any]:
        return self.raw["request"]

    @property
    def retry(self) -> dict[str, Any]:
        return self.raw["retry"]

    def length(self, dataset: str) -> dict[str, Any]:
        name = self.raw["datasets"].get(dataset)
        if name is None:
            raise ConfigError(f"run config {self.config_id} has no dataset {dataset!r}")
        return self.raw["lengths"][name]


class WorkerContext:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._runs: dict[str, RunView] = {}
        self._tokenizers: dict[tuple[str, str | None], TargetTokenizer] = {}
        self._lock = threading.Lock()

    @cached_property
    def redis(self) -> redis.Redis:
        # Bounded: an unbounded pool under 1,000 greenlets opens 1,000 sockets to Redis.
        pool = redis.BlockingConnectionPool.from_url(
            self.settings.require_redis_url(),
            max_connections=max(20, self.settings.worker_concurrency // 4),
            timeout=30,
            socket_timeout=30,
            socket_connect_timeout=10,
            health_check_interval=25,
            # Redis restarting must not cost a paid answer: commands wait for it (a settle only
            # while its lease lives, then it is spooled: workers/spool.py).
            retry=WindowRetry(self.settings.redis_retry_window_s),
            retry_on_error=list(UNREACHABLE),
        )
        return redis.Redis(connection_pool=pool)

    @cached_property
    def client(self) -> OpenRouterClient:
        key = self.settings.openrouter_api_key
        if not key:
            raise ConfigError("environment variable OPENROUTER_API_KEY is not set on this worker")
        return OpenRouterClient(
            self.settings.openrouter_base_url,
            key,
            pool_size=self.settings.worker_concurrency,
            app_url=self.settings.app_url,
            app_title=self.settings.app_title,
        )

    def run(self, config_id: str) -> RunView:
        view = self._runs.get(config_id)
        if view is None:
            raw = self.redis.get(keys.config(config_id))
            if raw is None:
                raise ConfigError(f"run config {config_id} is not in Redis ({keys.config(config_id)})")
            view = self._runs[config_id] = RunView(config_id, json.loads(raw))
        return view

    def tokenizer(self, view: RunView) -> TargetTokenizer:
        """Load (once per process) and start-up-check the run's target tokenizer."""
        model = view.model
        key = (model["tokenizer"], model.get("revision"))
        tok = self._tokenizers.get(key)
        if tok is None:
            with self._lock:
                tok = self._tokenizers.get(key)
                if tok is None:
                    log.info("loading target tokenizer %s", model["tokenizer"])
                    tok = TargetTokenizer.load(
                        model["tokenizer"],
                        trust_remote_code=bool(model.get("trust_remote_code")),
                        revision=model.get("revision"),
                    )
                    self._tokenizers[key] = tok
        return tok

    def prepare(self, config_id: str) -> None:
        """Everything a run needs before its first request; raises on a broken tokenizer."""
        view = self.run(config_id)
        self.tokenizer(view)
        if not self.settings.openrouter_api_key:
            raise ConfigError("environment variable OPENROUTER_API_KEY is not set on this worker")


_context: WorkerContext | None = None


def context() -> WorkerContext:
    global _context
    if _context is None:
        _context = WorkerContext(Settings.from_env())
    return _context


__all__ = ["RunView", "TokenizerError", "WorkerContext", "context"]
