"""The test harness's pool of warm workers (harness/warm.py) hands a worker out only on the Redis
store it was parked on: a test that empties Redis whole (a restart without persistence) gives the
store a new id, and a worker parked before it takes the next test's Redis for another and leaves
(workers/fleet/server.py), failing that test (seen in CI: test_plan's refused plan after one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import cast

from harness.warm import Warm, WarmPool, sim_settings
from harness.zygote import Process


def _parked(pool: WarmPool, key: tuple[object, ...], tmp: Path, store: bytes) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    pool.give(key, Warm(cast(Process, proc), tmp / "w.log", node="w1", store=store))
    return proc


def test_a_worker_parked_on_a_store_since_emptied_is_ended_not_handed_out(tmp_path: Path) -> None:
    pool = WarmPool()
    key = ("worker", "w1", "redis://x")
    stale = _parked(pool, key, tmp_path, b"old-store")
    assert pool.take(key, b"new-store") is None
    assert stale.wait(timeout=10) != 0  # ended, not left stopped
    same = _parked(pool, key, tmp_path, b"store")
    warm = pool.take(key, b"store")
    assert warm is not None and warm.proc.pid == same.pid
    same.kill()
    same.wait()
    pool.close()


def test_simulators_expecting_other_keys_are_never_handed_out_for_each_other(tmp_path: Path) -> None:
    """The simulator's settings mask its keys ("<set>"); the pool's key must not: the account test
    once got a simulator started with another test's management key (its credits route said 403)."""
    def key(*args: str) -> tuple[object, ...]:
        return sim_settings(args, tmp_path)[0]

    assert key("--management-key", "sk-or-mgmt") == key("--management-key", "sk-or-mgmt")
    assert key("--management-key", "sk-or-mgmt") != key("--management-key", "not-the-runs-key")
    assert key("--expect-key", "a") != key("--expect-key", "b") != key()
    assert "sk-or-mgmt" not in repr(key("--management-key", "sk-or-mgmt"))  # hashed, as the logs may show it
