"""The tests' fork server (harness/zygote.py): a forked producer or worker is the process a fresh
``python -m`` would be — its output, exit code, environment, cwd, session and signals — or the
tests it serves prove less than they claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.fleet import Fleet, free_port
from harness.zygote import Forked, Zygote, Zygotes


def _plain(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, timeout=120)
    return done.returncode, done.stdout.decode()


def _forked(zygote: Zygote, cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> tuple[int, str]:
    with log.open("wb") as fh:
        proc = zygote.launch(cmd, env, fh.fileno(), cwd=cwd)
    return proc.wait(timeout=120), log.read_text()


def test_a_forked_producer_says_and_exits_as_a_fresh_one(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text('[model]\nname = "x"\n[[datasets]]\nname = "A"\npath = 3\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECFLEET_", "REDIS_"))}
    closed = f"redis://127.0.0.1:{free_port()}/0"
    cases = [
        # the cwd: a relative run file is read where the launch says, and named as given
        ["check", "bad.toml"],
        ["check", "missing.toml"],
        # the environment: the launch's, not the zygote's (which never had this REDIS_URL)
        ["status"],
    ]
    zygote = Zygote("producer")
    try:
        for i, args in enumerate(cases):
            cmd = [sys.executable, "-m", "producer.cli", *args]
            run_env = {**env, "REDIS_URL": closed} if args == ["status"] else env
            assert zygote.suits(cmd, run_env)
            want = _plain(cmd, run_env, tmp_path)
            got = _forked(zygote, cmd, run_env, tmp_path, tmp_path / f"{i}.log")
            assert got == want, (args, got, want)
            assert want[0] != 0, want  # each case is an error a fresh process reports
            if args == ["check", "bad.toml"]:
                assert "bad.toml" in want[1], want  # read from the cwd: the field error, not a missing file
    finally:
        zygote.close()


def test_launches_a_fork_would_change_start_the_plain_way() -> None:
    zygote = Zygote("producer")
    cmd = [sys.executable, "-m", "producer.cli", "check", "x.toml"]
    assert zygote.suits(cmd, {})
    assert not zygote.suits(cmd, {"PYTHONHASHSEED": "7"})  # a fork keeps the zygote's hash seed
    assert not zygote.suits([sys.executable, "-m", "simulator"], {})
    assert Zygotes().launch([sys.executable, "-m", "simulator"], {}, 1) is None


def test_an_environment_gets_its_zygote_on_its_second_launch_so_one_offs_take_no_slot() -> None:
    zygotes = Zygotes(per_kind=1)
    cmd = [sys.executable, "-m", "producer.cli", "check", "x.toml"]
    for i in range(3):  # test_plan's hooks: a PYTHONPATH of each test's own, launched once
        assert zygotes.suiting(cmd, {"PYTHONPATH": f"/hook{i}"}) is None
    shared: dict[str, str] = {}
    assert zygotes.suiting(cmd, shared) is None
    zygote = zygotes.suiting(cmd, shared)
    assert zygote is not None and zygotes.suiting(cmd, shared) is zygote
    assert zygotes.suiting(cmd, {"PYTHONPATH": "/hook0"}) is None  # the kind's one slot is taken
    assert zygotes.suiting(cmd, {**shared, "PYTHONHASHSEED": "7"}) is None


def test_the_fleets_own_environment_gets_its_zygote_on_its_first_launch() -> None:
    fleet_env = {"PYTHONUNBUFFERED": "1", "REDIS_URL": "redis://a"}
    zygotes = Zygotes(common=[fleet_env])
    cmd = [sys.executable, "-m", "producer.cli", "check", "x.toml"]
    # What is not import environment (REDIS_URL, OPENROUTER_*…) differs from test to test.
    assert zygotes.suiting(cmd, {**fleet_env, "REDIS_URL": "redis://b"}) is not None
    assert zygotes.suiting(cmd, {"PYTHONPATH": "/hook"}) is None  # any other: still on its second


def test_a_forked_worker_serves_leads_its_session_and_dies_by_its_signal(tmp_path: Path, redis_client,  # type: ignore[no-untyped-def]
                                                                         redis_server) -> None:
    zygotes = Zygotes()  # a worker's environment gets its zygote on its first launch
    fleet = Fleet(tmp_path, redis_server.connection_url + "/0", None, zygotes)
    try:
        fleet.start_simulator()
        proc = fleet.start_worker("w1", concurrency=5)
        fleet.wait_ready("w1")
        assert isinstance(proc, Forked) and proc.poll() is None
        assert os.getsid(proc.pid) == proc.pid  # stop_all ends its group, as with start_new_session
        assert "w1@" in fleet.log("w1")  # celery's own banner: it runs celery's main
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        # One that outlives its zygote (the session's teardown order) is still waited for.
        second = fleet.start_worker("w2", concurrency=5)
        fleet.wait_ready("w2")
        zygotes.close()
        assert isinstance(second, Forked) and second.poll() is None
        os.kill(second.pid, signal.SIGKILL)
        assert second.wait(timeout=30) == -signal.SIGKILL
    finally:
        fleet.stop_all()
        zygotes.close()


def _zygotes_serving(run_dir: Path) -> list[int]:
    """The zygote processes listening in ``run_dir`` (their lock file is on their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"harness.zygote" in argv and any(arg.startswith(str(run_dir).encode()) for arg in argv):
            pids.append(int(proc.name))
    return pids


def test_the_runs_test_processes_share_one_zygote_that_ends_with_its_last_client(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECFLEET_", "REDIS_"))}
    cmd = [sys.executable, "-m", "producer.cli", "check", "missing.toml"]
    first, second = Zygote("producer", tmp_path), Zygote("producer", tmp_path)
    try:
        assert _forked(first, cmd, env, tmp_path, tmp_path / "1.log")[0] != 0
        assert _forked(second, cmd, env, tmp_path, tmp_path / "2.log")[0] != 0
        serving = _zygotes_serving(tmp_path)
        assert len(serving) == 1, serving  # the second test process found the first one's
        # so a third's first producer, which would start plainly in a run of its own, is forked
        assert Zygotes(run_dir=tmp_path).suiting(cmd, env) is not None
        assert Zygotes(run_dir=tmp_path / "elsewhere").suiting(cmd, env) is None
        first.close()
        assert _forked(second, cmd, env, tmp_path, tmp_path / "3.log")[0] != 0  # still served
        second.close()
        deadline = time.monotonic() + 10
        while _zygotes_serving(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _zygotes_serving(tmp_path) and not list(tmp_path.glob("*.sock"))
        # a test process that comes later starts the next one
        third = Zygote("producer", tmp_path)
        try:
            assert _forked(third, cmd, env, tmp_path, tmp_path / "4.log")[0] != 0
            assert len(_zygotes_serving(tmp_path)) == 1
        finally:
            third.close()
    finally:
        first.close()
        second.close()
