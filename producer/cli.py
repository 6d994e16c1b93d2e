"""``specfleet``: the one command line.

    specfleet run CONFIG        enqueue the config's datasets in order, watch budgets, write rows
    specfleet worker [ARGS]     a gevent Celery worker (exec's ``celery -A workers worker …``)
    specfleet demo              everything on embedded defaults: Valkey, simulator, 2 workers, a run
    specfleet simulate [ARGS]   the local OpenRouter simulator
    specfleet status [--watch]  progress of the run in Redis
    specfleet exporter          Prometheus metrics of the run in Redis
    specfleet check CONFIG      validate a run file and its datasets, send nothing
    specfleet plan CONFIG       prompts, prompt tokens and the run's cost before any request
    specfleet validate OUT      re-check every row of an output folder offline (exit 1 on a defect)
    specfleet export OUT DIR    an output folder as a Hugging Face dataset (Parquet, Arrow, card)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from common import dotenv, keys, logs
from common.config import load_config
from common.datasets import ReadStats, dataset_problem, read_prompts
from common.errors import ConfigError, DatasetRowError, RedisOutage, SpecfleetError
from common.fd_limit import raise_open_files
from common.redis_client import connect
from common.settings import Settings
from common.worker_cmd import pool_size, worker_argv
from producer.execute import SCRAPE_REDIS_WINDOW_S, execute

if TYPE_CHECKING:
    from producer.state import DatasetState

log = logging.getLogger("specfleet")


def _redis_for(settings: Settings, out_dir: Path) -> tuple[str, object | None]:
    """REDIS_URL, or a private Valkey persisted under the output folder."""
    if settings.redis_url:
        return settings.redis_url, None
    from producer.embedded import EmbeddedValkey

    server = EmbeddedValkey(out_dir / ".valkey")
    url = server.start()
    log.warning("REDIS_URL is not set: using a private Valkey at %s; workers elsewhere need REDIS_URL=%s",
                url, url)
    return url, server


def usable_output_dir(path: Path) -> None:
    """Refuse, before anything is sent or started, an output folder the run could never write: one
    under a regular file, a file itself, or one whose nearest existing folder is not writable."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        under = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise ConfigError(f"output folder {path} {under}: set [output] dir or --out to a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder {path}: {existing} is not writable by this user")


def cmd_run(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    cfg = load_config(args.config)
    if args.out is not None:
        cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": args.out.resolve()})})
    usable_output_dir(cfg.output.dir)
    plan = None
    if not args.no_plan:
        from producer.plan import start_plan

        # The model's entry now (an unknown model is refused here); the counts run beside the
        # run's start, which sends nothing until they pass.
        cfg, plan = start_plan(cfg, settings.openrouter_base_url, yes=args.yes, api_key=settings.openrouter_api_key)
    url, _server = _redis_for(settings, cfg.output.dir)
    return execute(cfg, settings, url, progress=not args.no_progress, metrics_port=args.metrics_port,
                   stall_s=args.stall_s, plan=plan)


def cmd_worker(args: argparse.Namespace) -> int:
    if {"-h", "--help"} & set(args.celery_args):  # help needs no environment: ours, then where celery's is
        parser().parse_args(["worker", "--help"])
    settings: Settings = args.settings
    settings.require_redis_url()
    argv = worker_argv(settings.worker_concurrency, extra=args.celery_args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Kept across the exec: celery's sockets get the room the host allows (common/fd_limit.py).
    raise_open_files(pool_size(settings.worker_concurrency))
    os.execvp(argv[0], argv)


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.__main__ import main as simulate

    return int(simulate(args.sim_args) or 0)


def cmd_status(args: argparse.Namespace) -> int:
    from common.batches import open_batches
    from common.throttle import FleetThrottle
    from producer.progress import ProgressView, batch_lines
    from producer.state import current_run, read_state

    client = connect(args.settings.require_redis_url(), SCRAPE_REDIS_WINDOW_S)
    run = current_run(client)
    if run is None:
        print("no run in this Redis")
        return 1
    names = run["datasets"]
    if args.json:
        print(json.dumps([read_state(client, n).to_json() for n in names], indent=2))
        return 0
    view = ProgressView(names, live=True if args.watch else None)
    throttle = FleetThrottle(client)
    try:
        while True:
            states = [read_state(client, n) for n in names]
            snapshot, batches = throttle.snapshot(), open_batches(client)
            view.update(states, snapshot, batches)
            ended = {st.dataset: why for st in states if (why := _end_reason(client, st))}
            for st in states:
                if st.dataset in ended:
                    view.finish(st, ended[st.dataset], snapshot, batches)
            # The run is over once every dataset ended: the last frame is its final state.
            if not args.watch or len(ended) == len(names):
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        view.close()
    print(_dead_letters(client))
    for line in batch_lines(open_batches(client)):
        print(line)
    return 0


def _end_reason(client: redis.Redis, st: DatasetState) -> str | None:
    """How a dataset ended, from the last timeline sample its producer wrote when it finalized it
    (None while it runs: a resumed dataset is active again, whatever an older sample says)."""
    if st.state == "active":
        return None
    raw = client.lindex(keys.DatasetKeys(st.dataset).timeline, -1)
    reason = json.loads(raw).get("end_reason") if raw else None
    return str(reason) if reason else None


def _dead_letters(client: redis.Redis) -> str:
    """The dead-letter list in one line: how many messages workers refused, and the newest."""
    counts = client.hgetall(keys.DEAD_LETTER_COUNTS)
    total = sum(int(v) for v in counts.values())
    line = f"dead letters: {total:,} (messages workers refused to run, none a prompt; {keys.DEAD_LETTERS})"
    newest = client.lindex(keys.DEAD_LETTERS, 0)
    if newest is not None:
        entry = json.loads(newest)
        line += f"; newest: {entry['reason']} from {entry['queue']}: {entry['detail']}"
    return line


def cmd_exporter(args: argparse.Namespace) -> int:
    from producer.metrics import start_metrics_server

    settings: Settings = args.settings
    client = connect(settings.require_redis_url(), SCRAPE_REDIS_WINDOW_S)
    port = settings.metrics_port if args.port is None else args.port
    start_metrics_server(client, port)
    log.info("metrics on :%d/metrics", port)
    while True:
        time.sleep(3600)


def cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    bad = 0
    for ds in cfg.datasets:
        errors: list[DatasetRowError] = []
        stats = ReadStats()
        why = dataset_problem(ds.path)
        if why:
            print(f"dataset {ds.name!r}: {why}")
            bad += 1
            continue
        for _ in read_prompts(ds.path, errors, stats, limit=ds.max_prompts, max_line_bytes=ds.max_line_bytes):
            pass
        for err in errors:
            print(err)
        print(f"{ds.name}: {stats.prompts:,} prompts, {stats.malformed:,} malformed, "
              f"{stats.duplicates:,} duplicate ids")
        # A file with no usable prompt, or rows the run would skip, is a problem to fix first.
        bad += stats.prompts == 0 or stats.malformed > 0 or stats.duplicates > 0
    return 1 if bad else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from producer.plan import check_plan

    settings: Settings = args.settings
    cfg = load_config(args.config)
    check_plan(cfg, settings.openrouter_base_url, yes=args.yes, api_key=settings.openrouter_api_key)
    if settings.redis_url:  # the Redis the run will use: does its maxmemory hold what the run needs?
        from producer import redis_memory
        from producer.window import WindowBounds

        window = WindowBounds(settings.queue_window_prompts, settings.queue_window_bytes)
        try:
            _, line = redis_memory.check(connect(settings.redis_url, SCRAPE_REDIS_WINDOW_S), cfg, window)
        except Exception as exc:  # the plan is printed: an unreachable Redis only leaves this unknown
            line = f"Redis memory: not checked ({type(exc).__name__}: {exc})"
        print(line)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from producer.validate import print_report, validate

    tokenizer, trust, revision = args.tokenizer, args.trust_remote_code, None
    if args.config is not None:
        model = load_config(args.config).model
        tokenizer = tokenizer or model.tokenizer
        trust, revision = trust or model.trust_remote_code, model.revision
    result = validate(args.out, tokenizer=tokenizer, trust_remote_code=trust, revision=revision)
    print_report(result)
    return 0 if result.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    from producer.export import export, push_to_hub

    result = export(args.out, args.dest, overwrite=args.overwrite, recipes=args.recipe)
    for split in result.splits:
        print(f"{split.name}: {split.rows:,} rows, {split.kept_tokens:,} kept tokens, {split.truncated:,} truncated")
    print(f"dataset in {result.dest} (load_from_disk: {result.dest / 'arrow'}; Parquet: {result.dest / 'data'}; "
          f"card: {result.card})")
    if args.push_to_hub:
        print(f"pushed: {push_to_hub(result, args.push_to_hub, private=args.private)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from producer.demo import run_demo

    return run_demo(args.settings, out_dir=Path(args.out), workers=args.workers, concurrency=args.concurrency)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a config's datasets")
    run.add_argument("config", type=Path, help="the run file (TOML; template: demo/fleet.toml)")
    run.add_argument("--out", type=Path, default=None, help="output folder (overrides [output] dir)")
    run.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    run.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")
    run.add_argument("--stall-s", type=float, default=None, help=argparse.SUPPRESS)
    run.add_argument("--yes", action="store_true", help="start even if the worst case exceeds [run] budget_usd")
    run.add_argument("--no-plan", action="store_true",
                     help="skip the plan (models endpoint, prompt tokens) before the run, e.g. offline")
    run.set_defaults(func=cmd_run)
    worker = sub.add_parser(
        "worker", help="start a gevent worker (extra args go to celery)",
        description="A gevent Celery worker: `celery -A workers worker -P gevent -c SPECFLEET_CONCURRENCY` and "
                    "the arguments given (celery's own: celery -A workers worker --help). Needs REDIS_URL and, "
                    "for OpenRouter, OPENROUTER_API_KEY; the run's config and tokenizer come through Redis.")
    worker.add_argument("celery_args", nargs=argparse.REMAINDER, help="passed on to celery")
    worker.set_defaults(func=cmd_worker)
    sim = sub.add_parser("simulate", help="the local OpenRouter simulator", add_help=False)
    sim.add_argument("sim_args", nargs=argparse.REMAINDER, help="passed on to the simulator")
    sim.set_defaults(func=cmd_simulate)
    status = sub.add_parser("status", help="progress of the run in Redis")
    status.add_argument("--watch", action="store_true", help="redraw every second until every dataset has ended")
    status.add_argument("--json", action="store_true", help="each dataset's state as JSON, once")
    status.set_defaults(func=cmd_status)
    exporter = sub.add_parser("exporter", help="serve Prometheus metrics of the run in Redis")
    # The default is read when the command runs, inside main's error handling: a bad
    # SPECFLEET_METRICS_PORT is then one `specfleet:` line, not a traceback from building the parser.
    exporter.add_argument("--port", type=int, default=None, help="default: SPECFLEET_METRICS_PORT (9808)")
    exporter.set_defaults(func=cmd_exporter)
    check = sub.add_parser("check", help="validate a run file and its datasets")
    check.add_argument("config", type=Path, help="the run file; exit 1 if a dataset has a problem")
    check.set_defaults(func=cmd_check)
    plan = sub.add_parser("plan", help="price a run and check its prompts fit, send nothing")
    plan.add_argument("config", type=Path, help="the run file")
    plan.add_argument("--yes", action="store_true", help="accept a worst case over [run] budget_usd")
    plan.set_defaults(func=cmd_plan)
    validate = sub.add_parser("validate", help="re-check every row of an output folder, offline")
    validate.add_argument("out", type=Path, help="an output folder (or one JSONL file of rows)")
    validate.add_argument("--config", type=Path, default=None,
                          help="the run file: its [model] tokenizer renders the rows (default: the manifest's)")
    validate.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id to render with")
    validate.add_argument("--trust-remote-code", action="store_true", help="for a remote-code tokenizer (Kimi's)")
    validate.set_defaults(func=cmd_validate)
    exp = sub.add_parser("export", help="an output folder as a Hugging Face dataset (Parquet, Arrow, card)")
    exp.add_argument("out", type=Path, help="the run's output folder")
    exp.add_argument("dest", type=Path, help="where the dataset goes (empty or new)")
    exp.add_argument("--overwrite", action="store_true", help="replace what dest holds")
    exp.add_argument("--recipe", action="append", metavar="NAME", default=None,
                     help="only rows asked with this sampling recipe (as the manifest names it; repeatable)")
    exp.add_argument("--push-to-hub", metavar="REPO", default=None,
                     help="also upload it to this Hub dataset repo (token: HF_TOKEN or huggingface-cli login)")
    exp.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    exp.set_defaults(func=cmd_export)
    demo = sub.add_parser("demo", help="the whole fleet on embedded defaults")
    demo.add_argument("--out", default="demo-out",
                      help="output folder: new, empty, or an earlier demo's (which it replaces)")
    demo.add_argument("--workers", type=int, default=2, help="worker processes to start")
    demo.add_argument("--concurrency", type=int, default=200, help="requests in flight per worker")
    demo.set_defaults(func=cmd_demo)
    return p


#: Subcommands whose arguments belong to another program: argparse's REMAINDER drops a leading
#: ``--option``, so these are split off before parsing.
_PASSTHROUGH = {"worker": "celery_args", "simulate": "sim_args"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # as compose does: the .env of the folder it runs in, under what the environment already says
        dotenv.load()
    except SpecfleetError as exc:
        print(f"specfleet: {exc}", file=sys.stderr)
        return exc.exit_code
    if argv and argv[0] in _PASSTHROUGH:
        args = parser().parse_args(argv[:1])
        setattr(args, _PASSTHROUGH[argv[0]], argv[1:])
    else:
        args = parser().parse_args(argv)
    try:
        # Read once per process: every command takes these (``args.settings``), never reads them again.
        args.settings = Settings.from_env()
        logs.configure(args.settings.log_level, args.settings.secrets)
        return int(args.func(args) or 0)
    except SpecfleetError as exc:  # each class's exit code (common/errors.py's table)
        print(f"specfleet: {exc}", file=sys.stderr)
        return exc.exit_code
    except redis.ConnectionError as exc:  # status/exporter/worker checks meet a Redis that is not there
        print(f"specfleet: cannot reach Redis: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, RedisOutage) else SpecfleetError.exit_code


if __name__ == "__main__":
    sys.exit(main())
