"""Per-process state of a worker: settings, Redis, the upstream, run views, tokenizers.

Built once per process by workers/bootstrap.py's ``boot`` (after Celery's gevent patching), which
makes it the process's (``context()``); shared by all greenlets. Its clients open on first use.
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property

import gevent.monkey
import redis

from common import keys, tokenizer_pin
from common.budget import group_commit
from common.config import WorkerView
from common.errors import ConfigError, TokenizerError
from common.logs import RedactSecrets
from common.manifest import resolve_tokenizer
from common.redis_client import connect
from common.settings import Settings
from common.target import TargetTokenizer
from common.throttle import FleetThrottle
from common.worker_cmd import pool_size
from workers.fleet.gate import Gate
from workers.fleet.group_commit import GroupCommit
from workers.fleet.heap import settle_long_lived
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Upstream
from workers.upstreams.vllm import EngineClient, EngineKind

log = logging.getLogger(__name__)

#: Connections of the throttle's gate: one pump call and the releases at a time, each a short script.
GATE_CONNECTIONS = 16


def _client(settings: Settings, *, max_connections: int) -> redis.Redis:
    # Redis restarting (or failing over) must not cost a paid answer: commands wait for it (a
    # settle only while its lease lives, then it is spooled: workers/fleet/spool.py).
    return connect(settings.require_redis_url(), settings.redis_retry_window_s, blocking_timeout_s=30,
                   max_connections=max_connections, socket_timeout=30, socket_connect_timeout=10)


class WorkerContext:
    """``upstream`` is OpenRouter unless given (tests pass an in-process fake)."""

    def __init__(self, settings: Settings, *, upstream: Upstream | None = None) -> None:
        self.settings = settings
        #: Takes the settings' API keys (and anything shaped like one) out of a text: a dead letter's bytes.
        self.scrub = RedactSecrets(list(settings.secrets)).scrub
        self._upstream = upstream
        self._runs: dict[str, WorkerView] = {}
        #: (tokenizer, revision, the pin as JSON) -> the loaded tokenizer
        self._tokenizers: dict[tuple[str, str | None, str], TargetTokenizer] = {}
        self._engines: dict[str, EngineClient] = {}
        self._lock = threading.Lock()

    @cached_property
    def redis(self) -> redis.Redis:
        # Bounded: an unbounded pool under 1,000 greenlets opens 1,000 sockets to Redis.
        client = _client(self.settings, max_connections=max(20, self.settings.worker_concurrency // 4))
        if gevent.monkey.is_module_patched("socket"):
            # A gevent worker: its greenlets' budget calls share pipelines and AOF fences. (An
            # in-process context in tests runs unpatched, where a greenlet batcher cannot help.)
            group_commit(client, GroupCommit(client))
        return client

    @cached_property
    def gate(self) -> Gate:
        """The process's door to the fleet-wide throttle: every upstream attempt passes it."""
        # Its own few connections: budget calls hold theirs through a WAITAOF (up to a second of
        # fsync), and a pump or a release queued behind them leaves fleet slots idle.
        return Gate(FleetThrottle(_client(self.settings, max_connections=GATE_CONNECTIONS)),
                    max_in_flight=self.settings.worker_concurrency,
                    borrow_up_to=self._most_in_flight(),
                    batch_releases=gevent.monkey.is_module_patched("socket"))

    @property
    def default_upstream(self) -> Upstream:
        """The upstream of runs that name none (OpenRouter, built on first use), or the one given
        (tests); ``redis`` is the Redis client."""
        if self._upstream is None:
            self._upstream = self._openrouter()
        return self._upstream

    def upstream(self, view: WorkerView) -> Upstream:
        """The upstream of this run: the one given to the context (tests), OpenRouter, or the
        self-hosted engine the run file's ``model.upstream`` names (one per kind and process)."""
        kind = view.model.upstream
        if self._upstream is not None or kind == "openrouter":
            return self.default_upstream
        engine = self._engines.get(kind)
        if engine is None:
            with self._lock:
                engine = self._engines.get(kind)
                if engine is None:
                    engine = self._engines[kind] = self._engine(kind)
        return engine

    def _most_in_flight(self) -> int:
        """Requests this process may have in flight, borrowing included (``Gate``): also the
        upstream connections it keeps (one over the HTTP pool's size is closed after each use)."""
        return pool_size(self.settings.worker_concurrency)

    def _engine(self, kind: EngineKind) -> EngineClient:
        url = self.settings.engine_url
        if not url:
            raise ConfigError(
                f"the run's model.upstream is {kind!r} but SPECFLEET_ENGINE_URL is not set on this worker")
        return EngineClient(kind, url, self.settings.engine_api_key, pool_size=self._most_in_flight())

    def _openrouter(self) -> OpenRouterClient:
        key = self.settings.openrouter_api_key
        if not key:
            raise ConfigError("environment variable OPENROUTER_API_KEY is not set on this worker")
        return OpenRouterClient(
            self.settings.openrouter_base_url,
            key,
            pool_size=self._most_in_flight(),
            app_url=self.settings.app_url,
            app_title=self.settings.app_title,
        )

    def run(self, config_id: str) -> WorkerView:
        view = self._runs.get(config_id)
        if view is None:
            raw = self.redis.get(keys.config(config_id))
            if raw is None:
                raise ConfigError(f"run config {config_id} is not in Redis ({keys.config(config_id)})")
            view = self._runs[config_id] = WorkerView.model_validate_json(raw)
        return view

    def tokenizer(self, view: WorkerView) -> TargetTokenizer:
        """Load (once per process) and start-up-check the run's target tokenizer: the run manifest's
        files (``view.tokenizer_pin``), or a refusal naming the file that differs."""
        model, pin = view.model, view.tokenizer_pin
        key = (model.tokenizer, model.revision, pin.model_dump_json() if pin is not None else "")
        tok = self._tokenizers.get(key)
        if tok is None:
            with self._lock:
                tok = self._tokenizers.get(key)
                if tok is None:
                    source, revision = self._tokenizer_source(view)
                    log.info("loading target tokenizer %s%s", model.tokenizer,
                             "" if source == model.tokenizer else f" from {source}")
                    tok = TargetTokenizer.load(source, trust_remote_code=model.trust_remote_code, revision=revision)
                    self._tokenizers[key] = tok
                    settle_long_lived(f"tokenizer {model.tokenizer} loaded")
        return tok

    def _tokenizer_source(self, view: WorkerView) -> tuple[str, str | None]:
        """Where this worker loads the run's tokenizer from, checked against the manifest's hashes
        before anything in it (remote code included) runs: the files the producer handed over through
        Redis, or (``SPECFLEET_TOKENIZER_FROM=local``, none handed over, or expired) ``[model]
        tokenizer`` as this host sees it."""
        model, pin = view.model, view.tokenizer_pin
        if pin is None:  # a producer from before the pin: nothing to check against
            return model.tokenizer, model.revision
        if pin.handoff is not None and self.settings.tokenizer_from == "redis":
            folder = tokenizer_pin.fetch(self.redis, pin, self.settings.tokenizer_cache_dir)
            if folder is not None:
                return str(folder), None
            log.warning("the run's tokenizer files are gone from Redis (%s): loading %s from this host",
                        keys.tokenizer_files(pin.handoff), model.tokenizer)
        folder, _ = resolve_tokenizer(model.tokenizer, model.revision)
        tokenizer_pin.check(folder, pin)
        return str(folder), None

    def prepare(self, config_id: str) -> None:
        """Everything a run needs before its first request; raises on a broken tokenizer."""
        view = self.run(config_id)
        self.tokenizer(view)
        if view.model.upstream != "openrouter":
            self.upstream(view)  # refuses a missing SPECFLEET_ENGINE_URL before the first task
        elif not self.settings.openrouter_api_key:
            raise ConfigError("environment variable OPENROUTER_API_KEY is not set on this worker")


_context: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    """Make ``ctx`` the process's context (workers/bootstrap.py's ``boot``, once per process)."""
    global _context
    _context = ctx


def context() -> WorkerContext:
    """The process's context, as ``boot`` built it; never built here (it would read the settings again)."""
    if _context is None:
        raise RuntimeError("no worker context in this process: workers/bootstrap.py's boot() has not run")
    return _context


__all__ = ["TokenizerError", "WorkerContext", "context", "install"]
