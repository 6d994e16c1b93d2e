"""A worker on a host whose open-files hard limit is below what it would ask for: it starts anyway,
with its soft limit raised to the hard one, and says so (compose used to ask the engine for 65,536
and the container refused to start where the hard limit was lower: 20,000 on these machines)."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from common.fd_limit import needed_open_files
from common.worker_cmd import pool_size
from tests.fleet import REPO, Fleet


def _limits(soft: int, hard: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return apply


def _soft_limit(pid: int) -> int:
    text = Path(f"/proc/{pid}/limits").read_text()
    m = re.search(r"^Max open files\s+(\d+)\s+(\d+)", text, re.M)
    assert m, text
    return int(m[1])


@pytest.mark.fleet
@pytest.mark.parametrize(("soft", "hard", "concurrency", "short"), [(512, 4096, 200, False), (256, 1024, 1000, True)],
                         ids=["enough", "hard-limit-too-low"])
def test_specfleet_worker_raises_its_soft_limit_to_the_hard_one(
        fleet: Fleet, soft: int, hard: int, concurrency: int, short: bool) -> None:
    assert (needed_open_files(pool_size(concurrency)) > hard) is short
    log_path = fleet.logs / "worker.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "worker"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_limits(soft, hard),
                                env=fleet.env(SPECFLEET_CONCURRENCY=str(concurrency)))
    fleet.procs["worker"] = proc
    # The same process becomes celery (exec), and celery keeps the raised limit; it starts and serves.
    fleet.wait_ready("worker", timeout_s=120)
    assert proc.poll() is None, fleet.log("worker")
    assert _soft_limit(proc.pid) == hard
    text = fleet.log("worker")
    assert f"open files: soft limit raised from {soft} to {hard} (hard limit {hard})" in text, text
    warned = "lower SPECFLEET_CONCURRENCY or raise the hard limit" in text
    assert warned is short, text
    assert b"celery" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
