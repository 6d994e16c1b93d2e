"""A worker starts explicitly (workers/bootstrap.py's ``boot``), never through an import.

Importing the app's modules reads no setting, installs no patch and configures no logging; a real
worker process (``specfleet worker``, which exec's celery) reads its ``Settings`` from the
environment once in each of its two interpreters, the CLI's and celery's, whatever it then does.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis

from common import keys
from common.logs import REDACTED
from common.settings import Settings
from tests.fleet import REPO, TEST_KEY, Fleet
from workers.fleet import poison
from workers.fleet.context import WorkerContext

#: Imports what ``celery -A workers worker`` imports before the worker is built, and every other
#: module of workers/, in an environment Settings.from_env would refuse; then reads the app's conf.
IMPORT_SCRIPT = """
import importlib, logging, os, pkgutil, sys
from common.settings import Settings
calls = []
_from_env = Settings.from_env.__func__
Settings.from_env = classmethod(lambda cls, env=None: (calls.append(1), _from_env(cls, env))[1])
handlers = list(logging.getLogger().handlers)

import workers
from workers.celery import app
for info in pkgutil.walk_packages(workers.__path__, "workers."):
    importlib.import_module(info.name)

from common.runtime import fingerprint, resolve
from workers import runtime
from workers.fleet import context, send_room, writes


def as_verified(patch):
    try:  # a patched target is specfleet's function (another source) or an object with none
        return fingerprint(resolve(patch.target)) == patch.fingerprint
    except (TypeError, OSError):
        return False


assert calls == [], f"Settings.from_env ran {len(calls)} time(s) at import"
patched = [p.name for p in runtime.PATCHES if not as_verified(p)]
assert patched == [], f"patched at import: {patched}"
assert send_room.process_room().concurrency == 0, "the send room was started at import"
assert writes._client is None, "the write probe was given a client at import"
assert logging.getLogger().handlers == handlers, "logging was configured at import"
try:
    context.context()
except RuntimeError:
    pass
else:
    raise AssertionError("a worker context exists without boot()")

os.environ.update(REDIS_URL="redis://127.0.0.1:1/0", SPECFLEET_CONCURRENCY="7")
assert app.conf.broker_transport_options["max_connections"] == 107  # the settings, read when the conf is
assert app.conf.worker_prefetch_multiplier == 1 and app.settings is app.settings
assert calls == [1], calls
print("ok")
"""


def test_importing_the_worker_changes_nothing_and_its_conf_reads_the_settings_when_asked() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           # Each would stop Settings.from_env: an import that read them could not succeed.
           "REDIS_URL": "localhost:6379", "SPECFLEET_CONCURRENCY": "lots"}
    out = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


#: On PYTHONPATH, in every interpreter of the worker: one line per Settings.from_env, naming the
#: interpreter (pid and a token of its own: celery exec'd by the CLI keeps the pid).
SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys, uuid

_ME = f"{os.getpid()}:{uuid.uuid4().hex}"


class _Count(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "common.settings":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from_env = module.Settings.from_env.__func__

            def counted(cls, env=None):
                # A forked child (the harness' zygote) is its own process: pid first.
                with open(os.environ["COUNT_FILE"], "a") as out:
                    out.write(f"{os.getpid()} {_ME} {os.path.basename(sys.argv[0])}\\n")
                return from_env(cls, env)

            module.Settings.from_env = classmethod(counted)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Count())
"""

N = 30


@pytest.mark.fleet
def test_a_worker_reads_its_settings_once_per_process(fleet: Fleet, redis_client: redis.Redis,
                                                      tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counts = tmp_path / "from_env.txt"
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("B", N)
    # As compose and the k8s manifest start it: `specfleet worker`, which exec's celery.
    worker = fleet._spawn("w1", [sys.executable, "-m", "producer.cli", "worker", "-n", "w1@%h"],
                          fleet.env(SPECFLEET_CONCURRENCY="10", PYTHONPATH=str(site), COUNT_FILE=str(counts)))
    fleet.wait_ready("w1")
    fleet.run_producer(config)  # every prompt through the worker: context, upstream, tokenizer, settle
    fleet.assert_exactly_once(redis_client, "B", N)
    assert worker.poll() is None, fleet.log("w1")
    lines = counts.read_text().splitlines()
    per_interpreter = Counter(line.split()[1] for line in lines)
    assert {line.split()[0] for line in lines} == {str(worker.pid)}, lines
    # The CLI's interpreter, then the celery it exec'd: one read each.
    assert len(per_interpreter) == 2 and set(per_interpreter.values()) == {1}, lines


def test_a_dead_letter_carries_no_key_of_the_settings(redis_client: redis.Redis) -> None:
    # The engine's key looks like no OpenRouter key: only the settings' secrets can take it out.
    settings = Settings.from_env({"SPECFLEET_ENGINE_API_KEY": "plain-engine-secret", "OPENROUTER_API_KEY": TEST_KEY})
    ctx = WorkerContext(settings)
    raw = json.dumps({"auth": "plain-engine-secret", "key": TEST_KEY}).encode()
    assert poison.admit(redis_client, raw, keys.queue("X"), scrub=ctx.scrub) is None
    entry = json.loads(redis_client.lindex(keys.DEAD_LETTERS, 0) or b"{}")
    kept = base64.b64decode(entry["raw_b64"]).decode()
    assert "plain-engine-secret" not in kept and TEST_KEY not in kept and kept.count(REDACTED) == 2, kept


@pytest.mark.parametrize(("env", "named"), [
    ({"REDIS_URL": "redis://127.0.0.1:1/0", "SPECFLEET_CONCURRENCY": "lots"}, "SPECFLEET_CONCURRENCY='lots'"),
    ({}, "REDIS_URL is not set"),
])
def test_a_bad_setting_stops_celerys_worker_in_one_line(env: dict[str, str], named: str) -> None:
    # `celery -A workers worker` run by hand (`specfleet worker` refuses before it exec's celery).
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "workers", "worker", "-P", "gevent", "-c", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env})
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and named in lines[0], out.stdout + out.stderr
