"""``specfleet demo``: the whole fleet on one machine with nothing configured.

A private Valkey, the local OpenRouter simulator (no key needed), two gevent worker processes and
the producer on ``demo/fleet.toml``. Starts from a clean output folder every time.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from common.config import load_config
from common.errors import ConfigError
from common.settings import Settings
from common.worker_cmd import worker_argv
from producer.execute import execute

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "demo" / "fleet.toml"
DEMO_TOKENIZER = REPO / "demo" / "tokenizer"
SIM_KEY = "sim-demo-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout_s:g} s")


def start_simulator(port: int, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", str(DEMO_TOKENIZER), *extra]
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/_sim/stats")
    return proc


def start_worker(index: int | None, env: dict[str, str], concurrency: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = worker_argv(concurrency, index=index)
    return subprocess.Popen(cmd, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # warm shutdown: running tasks finish
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait_for_workers(settings: Settings, redis_url: str, count: int, timeout_s: float = 60.0) -> None:
    """So the demo shows the whole fleet working from its first task, not one worker warming up."""
    from producer.celery_app import make_app

    app = make_app(settings, redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(app.control.ping(timeout=0.5)) >= count:
            return
    log.warning("only some of the %d workers answered within %.0f s; starting anyway", count, timeout_s)


#: The file that says a folder is a demo's own, so the next demo may replace it.
DEMO_MARK = ".specfleet-demo"


def clear_demo_folder(out_dir: Path) -> None:
    """The demo starts from an empty folder, but deletes only one it made: a new, empty or earlier
    demo's folder (its mark, or the logs/ and .valkey/ a demo from before the mark left)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file: give the demo a folder")
    entries = {p.name for p in out_dir.iterdir()}
    if not entries:
        return
    if DEMO_MARK not in entries and not {"logs", ".valkey"} <= entries:
        raise ConfigError(f"--out {out_dir} is not empty and was not made by specfleet demo (which starts over by "
                          "deleting its folder): give it a new or empty folder")
    print(f"starting over: deleting the previous demo's output in {out_dir}")
    shutil.rmtree(out_dir)


def run_demo(settings: Settings, out_dir: Path, workers: int, concurrency: int) -> int:
    """``settings``: the CLI's, read once (the workers it starts read their own)."""
    from producer.embedded import EmbeddedValkey
    from producer.plan import start_plan

    if settings.openrouter_api_key:
        print("OPENROUTER_API_KEY is set, but the demo never spends money: it runs on the local "
              "OpenRouter simulator. Use `specfleet run your.toml` for a real run.")
    else:
        print("OPENROUTER_API_KEY is not set: the demo uses the local OpenRouter simulator.")
    out_dir = out_dir.resolve()
    clear_demo_folder(out_dir)
    (out_dir / "logs").mkdir(parents=True)
    (out_dir / DEMO_MARK).write_text("made by `specfleet demo`: the next demo with this --out replaces it\n")
    cfg = load_config(DEMO_CONFIG)
    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": out_dir})})

    valkey = None
    redis_url = settings.redis_url
    if redis_url is None:
        valkey = EmbeddedValkey(out_dir / ".valkey")
        redis_url = valkey.start()
    else:
        print(f"REDIS_URL is set: the demo flushes nothing but uses that Redis ({redis_url}).")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sim_port = free_port()
        procs.append(start_simulator(sim_port, out_dir / "logs" / "simulator.log"))
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "OPENROUTER_BASE_URL": f"http://127.0.0.1:{sim_port}",
            "OPENROUTER_API_KEY": SIM_KEY,
            "SPECFLEET_CONCURRENCY": str(concurrency),
            "SPECFLEET_QUEUE_POLL_S": "0.5",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for i in range(workers):
            index = i + 1 if workers > 1 else None  # one worker keeps the plain specfleet@host name
            procs.append(start_worker(index, env, concurrency, out_dir / "logs" / f"worker{i + 1}.log"))
        _wait_for_workers(settings, redis_url, workers)
        print(f"{workers} workers × {concurrency} greenlets, simulator on :{sim_port}, Redis {redis_url}")
        # The price before the first request, as `specfleet run` prints it (the simulator's models list).
        cfg, plan = start_plan(cfg, f"http://127.0.0.1:{sim_port}", yes=True)
        return execute(cfg, settings, redis_url, plan=plan)
    finally:
        stop(procs)
        if valkey is not None:
            valkey.stop()
