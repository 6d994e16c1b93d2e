"""Prometheus metrics for what Flower cannot see: per-dataset queue, budget, tokens, cost, errors.

Flower's ``/metrics`` covers workers and task events; the budget lives in our Redis keys, so this
collector reads them at scrape time (``read_state`` per dataset of the current run: a handful of
pipelined commands) instead of keeping counters in a process that could restart and drift.
Served by ``specfleet exporter`` (its own process, the compose/k8s way) or inside the producer
(``specfleet run --metrics-port``). Scrape one of them, not both: the series are identical.

Counters are the totals kept in Redis; they restart at zero when a new run resets a dataset, which
Prometheus' ``rate()`` handles as a counter reset.

``specfleet_skipped_total`` counts what summary.json calls skipped: once a dataset's admission has
ended, its prompts without an outcome and not in flight (those purged from the queue at the budget
stop, those never queued, those workers held); before that, the tasks workers skipped. When the
dataset is finalized the two agree exactly.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from common import keys
from common.accounting import COUNTERS
from common.batches import open_batches
from common.errors import ConfigError
from common.stats import DUPLICATE_PROMPTS, EXCLUDED_PROMPTS, PROMPTS
from common.throttle import FleetThrottle, ThrottleSnapshot
from producer.progress import TokenRate
from producer.state import DatasetState, current_run, read_state

log = logging.getLogger(__name__)

_DS = ["dataset"]
_DS_REASON = ["dataset", "reason"]

# (name, help, DatasetState attribute) of the plain per-dataset series.
_GAUGES: list[tuple[str, str, str]] = [
    ("specfleet_queue_length", "Tasks waiting in the dataset's Celery queue (Redis list length)", "queued"),
    ("specfleet_budget_tokens", "Token budget of the dataset", "limit"),
    ("specfleet_reserved_tokens", "Estimated tokens of admitted requests still in flight", "reserved_tokens"),
    ("specfleet_failed", "Prompts whose last outcome is a failure (cleared if later kept)", "failed"),
    ("specfleet_in_flight", "Admitted requests holding a budget lease", "in_flight"),
    ("specfleet_budget_usd", "Dollar budget of the dataset (0: none)", "budget_usd"),
    ("specfleet_held_usd", "Worst-case dollars held for requests in flight and reaped ones", "held_usd"),
    ("specfleet_run_budget_usd", "Dollar budget of the whole run (0: none)", "run_budget_usd"),
    ("specfleet_run_spent_usd", "Dollars the budget counted across the run's datasets", "run_spent_usd"),
]
# The budget's own totals; then every counter of the accounting record, under its name.
_COUNTERS: list[tuple[str, str, str]] = [
    ("specfleet_kept_tokens", "Tokens of kept rows (sum of loss_mask), what the budget counts", "kept_tokens"),
    ("specfleet_rows", "Rows kept", "rows"),
    ("specfleet_spent_usd", "Dollars the budget counted: every billed answer, kept or not", "spent_usd"),
    *((f"specfleet_{c.name}", c.doc, c.name) for c in COUNTERS),
]


def run_datasets(run: dict[str, Any] | None) -> list[str]:
    """Dataset names of ``specfleet:run:current``; entries may be names or {"name": …} objects."""
    if not run:
        return []
    names = []
    for entry in run.get("datasets") or []:
        name = entry.get("name") if isinstance(entry, dict) else entry
        if isinstance(name, str) and name:
            names.append(name)
    return names


class SpecfleetCollector(Collector):
    """Reads the current run's dataset states from Redis on every scrape."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._throttle = FleetThrottle(client)
        self._rates: dict[str, TokenRate] = {}
        #: regenerate = "all" datasets of the run config last read (config_id, names).
        self._conversations: tuple[str, set[str]] = ("", set())
        # The HTTP server is threaded: two scrapes at once must not interleave rate windows.
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        # Empty: stops the registry from calling collect() (and Redis) at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("specfleet_redis_up", "1 if the last scrape could read Redis")
        try:
            run = current_run(self._client)
            states = [read_state(self._client, ds) for ds in run_datasets(run)]
            outcomes = self._outcomes(run, states)
            left_out = self._left_out(states)
            throttle = self._throttle.snapshot()
            batches = open_batches(self._client)
        except redis.RedisError as exc:
            # A scrape error would blank every series; say "Redis down" as a metric instead.
            log.warning("metrics: cannot read Redis: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        with self._lock:
            yield from self._families(run or {}, states, outcomes)
        yield from _left_out_families(left_out)
        if run:
            yield from _throttle_families(throttle)
        yield from _batch_families(batches)

    def _left_out(self, states: list[DatasetState]) -> list[tuple[str, Any, Any]]:
        """(dataset, duplicates, eval leaks) of each file, not asked (None until the producer has read it)."""
        pipe = self._client.pipeline(transaction=False)
        for st in states:
            pipe.hmget(keys.DatasetKeys(st.dataset).stats, DUPLICATE_PROMPTS, EXCLUDED_PROMPTS)
        return [(st.dataset, dup, exc) for st, (dup, exc) in zip(states, pipe.execute(), strict=True)]


    def _outcomes(self, run: dict[str, Any] | None, states: list[DatasetState]) -> dict[str, tuple[int, int]]:
        """(prompts in the file, prompts with a kept outcome) of each dataset whose producer has
        read its file: kept rows, or ended conversations for ``regenerate = "all"`` (a row per turn)."""
        conversations = self._conversation_datasets(run)
        pipe = self._client.pipeline(transaction=False)
        for st in states:
            pipe.hget(keys.DatasetKeys(st.dataset).stats, PROMPTS)
            pipe.scard(keys.DatasetKeys(st.dataset).ended)
        replies = pipe.execute()
        out = {}
        for st, prompts, ended in zip(states, replies[::2], replies[1::2], strict=True):
            if prompts is not None:
                out[st.dataset] = (int(prompts), int(ended) if st.dataset in conversations else st.rows)
        return out

    def _conversation_datasets(self, run: dict[str, Any] | None) -> set[str]:
        config_id = str((run or {}).get("config_id") or "")
        if config_id and config_id != self._conversations[0]:
            raw = self._client.get(keys.config(config_id))
            regenerate = json.loads(raw).get("regenerate") or {} if raw else {}
            self._conversations = (config_id, {n for n, mode in regenerate.items() if mode == "all"})
        return self._conversations[1]

    def _families(self, run: dict[str, Any], states: list[DatasetState],
                  outcomes: dict[str, tuple[int, int]]) -> Iterator[Metric]:
        info = GaugeMetricFamily("specfleet_run_info", "The run in progress (value 1)", labels=["config_id"])
        if run:
            info.add_metric([str(run.get("config_id", ""))], 1)
        yield info

        for name, doc, attr in _GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=_DS)
            for st in states:
                fam.add_metric([st.dataset], getattr(st, attr))
            yield fam
        for name, doc, attr in _COUNTERS:
            cfam = CounterMetricFamily(name, doc, labels=_DS)
            for st in states:
                cfam.add_metric([st.dataset], getattr(st, attr))
            yield cfam

        left = GaugeMetricFamily("specfleet_budget_left_tokens", "Budget minus kept tokens", labels=_DS)
        active = GaugeMetricFamily(
            "specfleet_dataset_active", "1 while the dataset admits requests, else 0", labels=_DS
        )
        rate = GaugeMetricFamily(
            "specfleet_kept_tokens_per_second",
            "Kept tokens per second over the last ~30 s of scrapes (absent after the first scrape)",
            labels=_DS,
        )
        errors = CounterMetricFamily(
            "specfleet_upstream_errors", "Upstream errors by class (http_429, timeout…)", labels=_DS_REASON
        )
        failures = CounterMetricFamily("specfleet_failures", "Prompts given up on, by reason", labels=_DS_REASON)
        prompts = GaugeMetricFamily(
            "specfleet_prompts", "Good prompts in the dataset's file (absent until the producer has read it)",
            labels=_DS,
        )
        skipped = CounterMetricFamily(
            "specfleet_skipped",
            "Prompts without an outcome once admission ended (summary.json's skipped); before, tasks workers skipped",
            labels=_DS,
        )
        for st in states:
            if st.dataset in outcomes:
                prompts.add_metric([st.dataset], outcomes[st.dataset][0])
            skipped.add_metric([st.dataset], _skipped(st, outcomes.get(st.dataset)))
            left.add_metric([st.dataset], max(0, st.limit - st.kept_tokens))
            active.add_metric([st.dataset], 1 if st.state == "active" else 0)
            tokens_s = self._rates.setdefault(st.dataset, TokenRate()).observe(st.t_s, st.kept_tokens)
            if tokens_s is not None:
                rate.add_metric([st.dataset], tokens_s)
            for reason, n in sorted(st.errors.items()):
                errors.add_metric([st.dataset, reason], n)
            for reason, n in sorted(st.failures.items()):
                failures.add_metric([st.dataset, reason], n)
        yield from (left, active, rate, errors, failures, prompts, skipped)


def _left_out_families(left_out: list[tuple[str, Any, Any]]) -> Iterator[Metric]:
    duplicates = GaugeMetricFamily(
        "specfleet_duplicate_prompts", "Prompts not asked: the same (normalised) as an earlier one of the run",
        labels=_DS)
    excluded = GaugeMetricFamily(
        "specfleet_excluded_prompts", "Prompts not asked: sharing a run of words with an eval set ([run] exclude)",
        labels=_DS)
    for dataset, dup, exc in left_out:
        if dup is not None:
            duplicates.add_metric([dataset], int(dup))
        if exc is not None:
            excluded.add_metric([dataset], int(exc))
    yield from (duplicates, excluded)


def _skipped(st: DatasetState, outcomes: tuple[int, int] | None) -> int:
    """summary.json's skipped (prompts - kept - failed) once admission has ended, less what is still
    in flight (it may land); until then, or before the producer has read the file, what workers skipped."""
    if outcomes is None or st.state in ("", "active"):
        return st.skipped_by_workers
    prompts, kept = outcomes
    return max(0, prompts - kept - st.failed - st.in_flight)


def _throttle_families(t: ThrottleSnapshot) -> Iterator[Metric]:
    """The fleet-wide upstream throttle (``common/throttle.py``): one series each, no labels."""
    limit = GaugeMetricFamily(
        "specfleet_throttle_limit",
        "Requests the whole fleet may have in flight now (adaptive: 429s cut it, answers grow it); "
        "absent while unbounded",
    )
    if t.limit is not None:
        limit.add_metric([], t.limit)
    in_flight = GaugeMetricFamily("specfleet_throttle_in_flight", "Upstream requests in flight, whole fleet")
    in_flight.add_metric([], t.in_flight)
    paused = GaugeMetricFamily(
        "specfleet_throttle_paused_seconds", "Seconds left of a Retry-After pause of the whole fleet"
    )
    paused.add_metric([], t.pause_ms_left / 1000)
    throttled = CounterMetricFamily(
        "specfleet_upstream_throttled", "Upstream attempts answered 429/503 (whole fleet, this run)"
    )
    throttled.add_metric([], t.throttled)
    answered = CounterMetricFamily("specfleet_upstream_ok", "Upstream attempts answered (whole fleet, this run)")
    answered.add_metric([], t.ok)
    refused = CounterMetricFamily(
        "specfleet_upstream_budget_refused",
        "Upstream attempts the account refused for its in-flight budget (402 in_flight_budget_exhausted; "
        "the fleet slows, no attempt spent; whole fleet, this run)",
    )
    refused.add_metric([], t.budget_refused)
    yield from (limit, in_flight, paused, throttled, answered, refused)


def _batch_families(batches: list[dict[str, Any]]) -> Iterator[Metric]:
    """Open Batch API batches (``common/batches.py``), by dataset and state (OpenRouter's word, or
    ``posting`` before the batch id is known)."""
    labels = ["dataset", "status"]
    count = GaugeMetricFamily("specfleet_batches_open", "Batch API batches not yet settled", labels=labels)
    requests_ = GaugeMetricFamily("specfleet_batch_requests_open", "Requests in open batches", labels=labels)
    age = GaugeMetricFamily("specfleet_batch_oldest_age_seconds", "Age of the oldest open batch", labels=labels)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for b in batches:
        groups.setdefault((b["dataset"], b["status"]), []).append(b)
    for (dataset, status), group in sorted(groups.items()):
        count.add_metric([dataset, status], len(group))
        requests_.add_metric([dataset, status], sum(b["requests"] for b in group))
        age.add_metric([dataset, status], max(b["age_s"] for b in group))
    yield from (count, requests_, age)


def make_registry(client: redis.Redis) -> CollectorRegistry:
    # Own registry: no process/GC collectors of whichever process hosts it, and tests can make many.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SpecfleetCollector(client))
    return registry


def start_metrics_server(client: redis.Redis, port: int) -> None:
    """Serves ``/metrics`` on 0.0.0.0:``port`` from a daemon thread; returns at once."""
    try:
        start_http_server(port, registry=make_registry(client))
    except OSError as exc:  # port taken or not ours to bind: the user's setting, said in one line
        raise ConfigError(f"cannot serve metrics on port {port}: {exc.strerror or exc}") from None
    log.info("metrics: serving http://0.0.0.0:%d/metrics", port)
