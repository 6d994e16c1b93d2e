"""One run from start to report: what ``specfleet run`` and ``specfleet demo`` both do once they
have a config and a Redis. The run's exit codes are chosen here, by the error tree's table
(``exit_code`` of common/errors.py's classes)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import RunConfig
from common.errors import Halted, Interrupted, OutputError, ProducerFenced, RedisOutage, RedisRefusesWrites
from common.redis_client import CLOCK, connect, describe
from common.redis_server import require_supported
from common.settings import Settings

if TYPE_CHECKING:
    from producer.plan import PendingPlan
    from producer.run import Runner

log = logging.getLogger("specfleet")

# The codes of the errors that end a run are their classes' (common/errors.py, the one table).
EXIT_INTERRUPTED = Interrupted.exit_code
EXIT_HALTED = Halted.exit_code
EXIT_REDIS_UNREACHABLE = RedisOutage.exit_code
#: Another producer took the lock (a newer generation) while this one was paused: it wrote nothing more.
EXIT_FENCED = ProducerFenced.exit_code
#: Redis took no writes (full, or a read-only replica) for the whole retry window.
EXIT_REDIS_REFUSES_WRITES = RedisRefusesWrites.exit_code
# No error's code: distinct from every class's (tests/test_errors.py).
#: SIGTERM/SIGINT while Redis was unreachable: the rows written are durable on disk, Redis could not be told.
EXIT_STOPPED_REDIS_AWAY = 7
#: How long after SIGTERM/SIGINT a producer that cannot reach Redis exits at the latest. What it
#: wrote is durable on disk already (each batch with its checkpoint) and Redis cannot be told
#: anything: waiting for the retry window would only keep the process alive for minutes.
STOP_WHILE_AWAY_S = 5.0
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
    from producer.run import Runner, Tuning
    from producer.state import read_timeline
    from producer.summary import report_line
    from producer.window import WindowBounds

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
        tuning=Tuning(stall_s=stall_s or Tuning.stall_s,
                      window=WindowBounds(settings.queue_window_prompts, settings.queue_window_bytes)),
        plan=plan,
    )
    threading.Thread(target=_stop_while_away, args=(runner, redis_url, cfg.output.dir), name="stop-watch",
                     daemon=True).start()
    try:
        # RedisTooOld (a ConfigError: one line, exit 2) before the run writes anything; in this try, a
        # Redis that is not there is the outage it always was (exit 4), and a metrics port taken was told first.
        require_supported(client)
        summaries = runner.run()
    except Interrupted:
        print("interrupted: state is kept in Redis; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Halted as exc:
        print(f"specfleet: halted: {exc}", file=sys.stderr)
        return EXIT_HALTED
    except RedisRefusesWrites as exc:
        if runner.interrupted:
            print("interrupted: state is kept in Redis; run the same command again to resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"specfleet: stopped: {exc.what}; nothing was lost: run the same command again once Redis takes "
              "writes (SPECFLEET_REDIS_RETRY_WINDOW_S sets how long to wait)", file=sys.stderr)
        return EXIT_REDIS_REFUSES_WRITES
    except ProducerFenced as exc:
        print(f"specfleet: stopped: {exc}", file=sys.stderr)
        return EXIT_FENCED
    except RedisOutage as exc:
        if runner.interrupted:
            return _stopped_while_away(redis_url, cfg.output.dir)
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


def _stopped_while_away(redis_url: str, out_dir: Path) -> int:
    print(f"specfleet: stopped while Redis at {describe(redis_url)} was unreachable: every row written is "
          f"durable in {out_dir} (with its checkpoint); Redis could not be told, and the producer lock "
          "expires by itself: run the same command again once Redis is back", file=sys.stderr, flush=True)
    return EXIT_STOPPED_REDIS_AWAY


def _stop_while_away(runner: Runner, redis_url: str, out_dir: Path) -> None:
    """Once stopping, a producer whose Redis is unreachable exits within ``STOP_WHILE_AWAY_S``:
    its threads would otherwise wait in their retries for the whole window. It exits hard, once no
    batch is half written (the folder is as after a crash: recovery needs nothing from Redis)."""
    runner.wait_interrupted()
    stop_by = time.monotonic() + STOP_WHILE_AWAY_S
    while time.monotonic() < stop_by or CLOCK.down_since is None:
        time.sleep(0.1)
    from producer.rows import stop_writing

    stop_writing(timeout_s=2.0)
    code = _stopped_while_away(redis_url, out_dir)
    logging.shutdown()
    os._exit(code)
