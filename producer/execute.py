"""One run from start to report: what ``specfleet run`` and ``specfleet demo`` both do once they
have a config and a Redis. Exit codes live here, next to the only code that chooses them."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from common.config import RunConfig
from common.errors import OutputError, ProducerFenced
from common.redis_client import RedisOutage, connect, describe
from common.settings import Settings

if TYPE_CHECKING:
    from producer.plan import PendingPlan

log = logging.getLogger("specfleet")

EXIT_INTERRUPTED = 130
EXIT_HALTED = 3
EXIT_REDIS_UNREACHABLE = 4
#: Another producer took the lock (a newer generation) while this one was paused: it wrote nothing more.
EXIT_FENCED = 5
#: A scrape must answer within Prometheus' timeout: the exporter waits this long for Redis per
#: scrape, then reports specfleet_redis_up 0 (and keeps serving).
SCRAPE_REDIS_WINDOW_S = 3.0


def execute(
    cfg: RunConfig,
    settings: Settings,
    redis_url: str,
    *,
    progress: bool = True,
    metrics_port: int | None = None,
    stall_s: float | None = None,
    plan: PendingPlan | None = None,
) -> int:
    """Run a config to its end against ``redis_url`` and print the per-dataset report. ``plan``:
    the plan still counting (``producer/plan.start_plan``); the run holds every request until it passes."""
    from producer.celery_app import make_app
    from producer.progress import ProgressView
    from producer.run import Halted, Interrupted, Runner, Tuning
    from producer.state import read_timeline
    from producer.summary import report_line

    client = connect(redis_url, settings.redis_retry_window_s)
    if metrics_port:
        from producer.metrics import start_metrics_server

        start_metrics_server(connect(redis_url, SCRAPE_REDIS_WINDOW_S), metrics_port)
        log.info("metrics on :%d/metrics", metrics_port)
    names = [d.name for d in cfg.datasets]
    runner = Runner(
        cfg,
        client,
        make_app(settings, redis_url),
        progress=ProgressView(names) if progress else None,
        tuning=Tuning(stall_s=stall_s) if stall_s else Tuning(),
        plan=plan,
    )
    try:
        summaries = runner.run()
    except Interrupted:
        print("interrupted: state is kept in Redis; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Halted as exc:
        print(f"specfleet: halted: {exc}", file=sys.stderr)
        return EXIT_HALTED
    except ProducerFenced as exc:
        print(f"specfleet: stopped: {exc}", file=sys.stderr)
        return EXIT_FENCED
    except RedisOutage as exc:
        print(f"specfleet: stopped: {exc} at {describe(redis_url)}; the state is kept in Redis and "
              f"{cfg.output.dir}: run the same command again once Redis is back "
              "(SPECFLEET_REDIS_RETRY_WINDOW_S sets how long to wait)", file=sys.stderr)
        return EXIT_REDIS_UNREACHABLE
    # Imported once the run is over: matplotlib costs ~0.5 s of CPU, which at the start would delay
    # the first prompt (and the plan) by as much.
    from producer.report import write_report

    try:
        report = write_report(cfg.output.dir, summaries, {n: read_timeline(client, n) for n in names})
    except OSError as exc:  # the rows and summaries are written; only the report is missing
        raise OutputError(f"cannot write the report in {cfg.output.dir}: {exc.strerror or exc}") from None
    print()
    for s in summaries:
        print(report_line(s))
    print(f"rows: {cfg.output.dir}/<dataset>/shard-*.jsonl · report: {report}")
    return 0
