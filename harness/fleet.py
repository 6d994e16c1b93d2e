"""A real fleet for tests and benches: simulator, ``celery worker`` processes and the producer as subprocesses.

Everything runs as it would in production (real Redis protocol, real gevent workers, real HTTP);
only timings are shortened. Logs go to files under the test's tmp dir and are printed on failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests

from common import keys
from common.budget import Budget
from common.worker_cmd import worker_argv
from harness.warm import Warm, WarmPool, kill_group, sim_settings
from harness.zygote import Process, Zygotes

REPO = Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = REPO / "demo" / "tokenizer"
TEST_KEY = "sk-or-v1-" + "5ec7e7" * 10  # shaped like a real key, so redaction is tested for real


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    """What every process a fleet starts inherits, before its test's own settings: this process's
    environment without OpenRouter's or specfleet's variables. Most launches of a run share its
    import environment, so the run's zygotes serve it from the first (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENROUTER_", "SPECFLEET_"))}
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def write_jsonl(path: Path, rows: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return path


def prompts(n: int, prefix: str = "p") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i:05d}", "messages": [{"role": "user", "content": f"Question {i}: explain {i} ✓"}]}
            for i in range(n)]


def read_rows(out_dir: Path, dataset: str, *, truncated: bool = True) -> list[dict[str, Any]]:
    """The dataset's kept rows: the shards' and (``truncated``) truncated.jsonl's, the rows cut by
    max_tokens that ``[request] truncated = "separate"`` (the default) writes beside them."""
    folder = out_dir / dataset
    files = sorted(folder.glob("shard-*.jsonl")) + ([folder / "truncated.jsonl"] if truncated else [])
    rows = []
    for path in files:
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return rows


def read_summary(out_dir: Path, dataset: str) -> dict[str, Any]:
    return json.loads((out_dir / dataset / "summary.json").read_text())


@dataclass
class Shared:
    """A simulator or worker of this test's that may go to the pool, or came from it."""

    key: tuple[object, ...]
    warm: Warm
    #: where its log began for this test (a pooled process's log holds the tests before)
    log_start: int = 0
    #: taken running from the pool rather than started by this test
    reused: bool = False


class Fleet:
    def __init__(self, tmp_path: Path, redis_url: str, pool: WarmPool | None = None,
                 zygotes: Zygotes | None = None) -> None:
        self.tmp = tmp_path
        self.redis_url = redis_url
        self.logs = tmp_path / "logs"
        self.logs.mkdir(exist_ok=True)
        self.out = tmp_path / "out"
        self.procs: dict[str, Process] = {}
        #: pids of the processes _spawn started, each the leader of a process group of its own.
        self._leaders: set[int] = set()
        self.sim_url = ""
        self.pool = pool
        #: producers and workers are forked from these where they suit (harness/zygote.py)
        self.zygotes = zygotes
        #: the simulator and workers this test may hand on to the pool, by name
        self._warm: dict[str, Shared] = {}
        #: names a test signalled: a stopped or stopping process is handed on to nobody
        self._signalled: set[str] = set()

    # --- processes --------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = base_env()
        env.update(
            REDIS_URL=self.redis_url,
            OPENROUTER_BASE_URL=self.sim_url,
            OPENROUTER_API_KEY=TEST_KEY,
            SPECFLEET_QUEUE_POLL_S="0.3",
            SPECFLEET_VISIBILITY_TIMEOUT_S="20",
            # Each test's own: fleets of parallel tests run the same datasets (workers/fleet/spool.py).
            SPECFLEET_SPOOL_DIR=str(self.tmp / "spool"),
        )
        env.update(extra)
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> Process:
        log = (self.logs / f"{name}.log").open("ab")
        # A session of its own, so stop_all can end what it started too (the producer's forked plan
        # count outlived its SIGKILLed parent by 10 s or more, using a core the next tests needed).
        proc: Process | None = self.zygotes.launch(cmd, env, log.fileno()) if self.zygotes is not None else None
        if proc is None:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
        log.close()
        self.procs[name] = proc
        self._leaders.add(proc.pid)
        return proc

    def _store_id(self) -> bytes | None:
        with redis.Redis.from_url(self.redis_url, socket_timeout=5) as client:
            store: bytes | None = client.get(keys.STORE_ID)
            return store

    def _take_warm(self, name: str, key: tuple[object, ...]) -> Warm | None:
        warm = self.pool.take(key, self._store_id()) if self.pool is not None else None
        if warm is not None:
            self.procs[name] = warm.proc
            self._leaders.add(warm.proc.pid)
            self._warm[name] = Shared(key, warm, log_start=warm.log.stat().st_size, reused=True)
        return warm

    def _mark_warm(self, name: str, key: tuple[object, ...], url: str = "",
                   settings: dict[str, Any] | None = None, node: str = "") -> None:
        if self.pool is not None:
            warm = Warm(self.procs[name], self.logs / f"{name}.log", url, settings, node)
            self._warm[name] = Shared(key, warm)

    def start_simulator(self, *args: str) -> str:
        """A simulator started with ``args``; from the pool, one started with other latencies,
        prices, capacities… is reset and given this test's settings (``harness.warm.sim_settings``)."""
        key, live = sim_settings(args, DEMO_TOKENIZER)
        warm = self._take_warm("simulator", key)
        if warm is not None:
            launched = warm.settings or {}
            requests.post(warm.url + "/_sim/reset", timeout=5).raise_for_status()
            patch = {n: v for n, v in live.items() if launched.get(n) != v}
            if requests.post(warm.url + "/_sim/config", json=patch, timeout=5).ok:
                self.sim_url = warm.url
                return self.sim_url
            # A value /_sim/config refuses (an empty list…): a simulator of its own, then.
            self._kill(warm.proc)
            warm.proc.wait()
            del self._warm["simulator"]
        port = free_port()
        self._spawn("simulator", [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", str(port),
                                  "--tokenizer", str(DEMO_TOKENIZER), *args], self.env())
        self.sim_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                requests.get(self.sim_url + "/_sim/stats", timeout=1)
                self._mark_warm("simulator", key, self.sim_url, live)
                return self.sim_url
            except requests.RequestException:
                time.sleep(0.1)
        raise AssertionError("simulator did not start:\n" + self.log("simulator"))

    def sim_config(self, **settings: Any) -> None:
        requests.post(self.sim_url + "/_sim/config", json=settings, timeout=5).raise_for_status()

    def sim_stats(self) -> dict[str, Any]:
        return requests.get(self.sim_url + "/_sim/stats", timeout=5).json()

    def sim_requests(self) -> list[dict[str, Any]]:
        """The simulator's record of every chat request: prompt, start_s, end_s, status (wall clock)."""
        return requests.get(self.sim_url + "/_sim/requests", timeout=30).json()["requests"]

    def start_worker(self, name: str, *, concurrency: int = 50, celery_args: tuple[str, ...] | None = None,
                     **env: str) -> Process:
        """A worker as ``specfleet worker`` starts it, named ``<name>@%h`` unless ``celery_args`` names it."""
        extra = ("-n", f"{name}@%h") if celery_args is None else celery_args
        key = ("worker", name, self.redis_url, self.sim_url, concurrency, extra, tuple(sorted(env.items())))
        warm = self._take_warm(name, key)
        if warm is not None:
            return warm.proc
        cmd = worker_argv(concurrency, extra=extra)
        proc = self._spawn(name, cmd, self.env(SPECFLEET_CONCURRENCY=str(concurrency), **env))
        self._mark_warm(name, key, node=cmd[cmd.index("-n") + 1].replace("%h", "") if "-n" in cmd else "")
        return proc

    def producer_cmd(self, config: Path, *extra: str) -> list[str]:
        # --yes: a small dollar budget is what tests use, and the plan would ask to confirm it
        # (tests/test_plan.py tests that question on its own).
        return [sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress", "--stall-s", "5", "--yes",
                *extra]

    def start_producer(self, config: Path, name: str = "producer", *extra: str,
                       env: dict[str, str] | None = None) -> Process:
        """``env``: variables for this producer only (e.g. ``SPECFLEET_QUEUE_WINDOW_PROMPTS``)."""
        return self._spawn(name, self.producer_cmd(config, *extra), self.env(**(env or {})))

    def run_producer(self, config: Path, *, timeout_s: float = 180, name: str = "producer",
                     env: dict[str, str] | None = None) -> str:
        proc = self.start_producer(config, name, env=env)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"producer did not finish in {timeout_s} s\n{self.all_logs()}") from None
        out = self.log(name)
        assert proc.returncode == 0, f"producer exit {proc.returncode}\n{self.all_logs()}"
        return out

    def wait_ready(self, name: str, timeout_s: float = 90) -> None:
        """Until worker ``name`` has started consuming (Celery logs "ready.")."""
        if name in self._warm and self._warm[name].reused:
            return  # taken running from the pool: it was ready for the test before
        deadline = time.monotonic() + timeout_s
        while "ready." not in self.log(name):
            assert self.procs[name].poll() is None and time.monotonic() < deadline, self.log(name)
            time.sleep(0.2)

    def wait_for(self, predicate: Callable[[], object], timeout_s: float, what: str) -> None:
        """Until ``predicate()`` is true; past ``timeout_s`` the test fails naming ``what``, with every log."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.all_logs()}"
            time.sleep(0.1)

    def wait_rows(self, client: Any, dataset: str, n: int, timeout_s: float = 60) -> None:
        """Until ``n`` rows of ``dataset`` are kept: a point mid-run to break something at."""
        deadline = time.monotonic() + timeout_s
        while Budget(client, dataset).snapshot().rows < n:
            assert time.monotonic() < deadline, self.all_logs()
            time.sleep(0.1)

    def assert_exactly_once(self, client: Any, dataset: str, n: int | None = None) -> list[dict[str, Any]]:
        """Each prompt at most once across the shards, the budget counted exactly those rows, and none
        was billed other token counts than its ids hold (the simulator bills with the run's tokenizer:
        a flag here is a false one, common/usage_check.py)."""
        rows = read_rows(self.out, dataset)
        ids = Counter(r["id"] for r in rows)
        assert not [i for i, c in ids.items() if c > 1], "a prompt id appears twice across the shards"
        snap = Budget(client, dataset).snapshot()
        assert snap.kept_tokens == sum(r["num_tokens"] for r in rows), "budget and rows disagree"
        assert snap.rows == len(rows)
        for r in rows:
            assert sum(r["loss_mask"]) == r["num_tokens"]
            assert len(r["input_ids"]) == len(r["loss_mask"])
        flagged = [(r["id"], r["usage_check"]) for r in rows if (r.get("usage_check") or {}).get("match") is False]
        assert not flagged, f"{len(flagged)} rows flagged usage_check, e.g. {flagged[:3]}"
        if n is not None:
            assert len(rows) == n, f"{len(rows)} rows of {dataset}, expected {n}"
        return rows

    def signal(self, name: str, sig: int) -> None:
        self._signalled.add(name)
        self.procs[name].send_signal(sig)

    def stop_all(self, hand_on: bool = False) -> None:
        """The test is over: nothing left is worth a graceful stop (a warm worker shutdown costs
        ~5 s each; graceful stops have tests of their own in test_operations.py). ``hand_on`` (the
        test passed): its simulator and workers go back to the pool, if it has one, when the rest
        is stopped and they are idle (``_idle``)."""
        warm = {name: shared for name, shared in self._warm.items()
                if name not in self._signalled and shared.warm.proc.poll() is None}
        keep = set(warm) if hand_on and warm and self.pool is not None else set()
        for name, proc in self.procs.items():
            if name not in keep:
                self._kill(proc)
        if keep and not self._idle():
            for name in keep:
                self._kill(self.procs[name])
            keep = set()
        for name, proc in self.procs.items():
            if name not in keep:
                proc.wait()
        store = self._store_id() if keep else None
        for name in keep:
            assert self.pool is not None
            warm[name].warm.store = store
            self.pool.give(warm[name].key, warm[name].warm)

    def _kill(self, proc: Process) -> None:
        if proc.pid in self._leaders:
            kill_group(proc)
        elif proc.poll() is None:
            proc.kill()

    def _idle(self, timeout_s: float = 1.5) -> bool:
        """No task queued or delivered and no request at the simulator: a test may get this fleet.
        A fleet still busy after ``timeout_s`` stays busy (tasks a halted or killed run left queued
        or unacked wait for a visibility timeout): waiting 5 s for it cost eight tests a run 40 s of
        wall, and only ever ended in a kill."""
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                queued = sum(int(client.llen(k)) for k in client.scan_iter(match=keys.QUEUE_PREFIX + "*"))
                busy = queued + int(client.hlen("unacked"))
                if busy == 0 and "simulator" in self._warm:
                    busy = int(self.sim_stats()["in_flight"])
                if busy == 0:
                    return self._reachable(client)
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
        except (redis.RedisError, requests.RequestException):
            return False
        finally:
            client.close()

    # --- files ------------------------------------------------------------------------------

    def _reachable(self, client: redis.Redis) -> bool:
        """Whether each worker to hand on still has its broadcast binding (the producer's ping,
        follow and cancel commands reach a worker through it): a test that flushed Redis took it."""
        bound = {m.rsplit(b"\x06\x16", 1)[-1].decode() for m in client.smembers("_kombu.binding.celery.pidbox")}
        workers = [shared for shared in self._warm.values() if shared.key[0] == "worker"]
        return all(shared.warm.node and any(b.startswith(shared.warm.node) for b in bound) for shared in workers)

    def log(self, name: str, *, whole: bool = False) -> str:
        """``name``'s log: for a process taken from the pool, what it wrote since this test took it
        (``whole``: since it started, for what a process says once in its life)."""
        if name in self._warm and self._warm[name].reused:
            shared = self._warm[name]
            with shared.warm.log.open("rb") as fh:
                fh.seek(0 if whole else shared.log_start)
                return fh.read().decode(errors="replace")
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def all_logs(self) -> str:
        names = sorted({p.stem for p in self.logs.glob("*.log")} | set(self._warm))
        return "\n".join(f"===== {name}.log\n{self.log(name)[-6000:]}" for name in names)

    def one_dataset(self, name: str, n_prompts: int, *, budget_tokens: int = 10_000_000,
                    **config: Any) -> Path:
        """A run file with one short dataset of ``n_prompts`` generated prompts."""
        data = write_jsonl(self.tmp / f"{name.lower()}.jsonl", prompts(n_prompts, name.lower()))
        return self.write_config(
            [{"name": name, "path": data, "length": "short", "budget_tokens": budget_tokens}], **config)

    def write_config(self, datasets: list[dict[str, Any]], *, timeout_s: float = 10, max_attempts: int = 4,
                     estimate_tokens: int | None = None, request: str = "", tokenizer: Path = DEMO_TOKENIZER,
                     trust_remote_code: bool = False, truncated: str | None = "keep",
                     duplicates: str | None = "ask", run: str = "", model: str = "",
                     degenerate: str | None = "keep") -> Path:
        """``truncated``: ``[request] truncated``, unless ``request`` sets it. The harness keeps rows
        cut by max_tokens in the shards (``keep``), as every test written before the policy expects
        (the simulator cuts a share of answers at the harness' max_tokens); None: the product's
        default. ``duplicates``: ``[run] duplicates``, unless ``run`` (more ``[run]`` lines) sets it:
        ``ask`` (every prompt asked) as every test written before the policy expects (``prompts``
        gives each dataset the same questions under its own ids); None: the product's default.
        ``degenerate``: ``[request] degenerate``, unless ``request`` sets it: ``keep``, as tests of
        scripted answers (reasoning then no content) expect; ``model``: more ``[model]`` lines."""
        policy = [] if truncated is None or "truncated" in request else [f'truncated = "{truncated}"']
        if degenerate is not None and "degenerate" not in request:
            policy.append(f'degenerate = "{degenerate}"')
        run_lines = [] if duplicates is None or "duplicates" in run else [f'duplicates = "{duplicates}"']
        lines = [
            "[model]", 'name = "moonshotai/kimi-k2.5"', f'tokenizer = "{tokenizer}"',
            f"trust_remote_code = {str(trust_remote_code).lower()}", model, "",
            "[request]", request or "temperature = 1.0", *policy, "",
            "[lengths.short]", "max_tokens = 1024", f"timeout_s = {timeout_s}",
            f"estimate_tokens = {estimate_tokens}" if estimate_tokens else "",
            "", "[lengths.long]", "max_tokens = 4096", f"timeout_s = {timeout_s}", "",
            "[retry]", f"max_attempts = {max_attempts}", "backoff_base_s = 0.05", "backoff_max_s = 0.5", "",
            "[output]", f'dir = "{self.out}"', "shard_rows = 100", "",
            "[run]", run, *run_lines, "",
        ]
        for ds in datasets:
            lines.append("[[datasets]]")
            for key, value in ds.items():
                lines.append(f"{key} = {json.dumps(str(value)) if isinstance(value, str | Path) else value}")
            lines.append("")
        path = self.tmp / "fleet.toml"
        path.write_text("\n".join(lines))
        return path
