"""The tests' fork server (harness/zygote.py): a forked producer or worker is the process a fresh
``python -m`` would be — its output, exit code, environment, cwd, session and signals — or the
tests it serves prove less than they claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from harness.fleet import Fleet, free_port
from harness.zygote import Zygote, Zygotes


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


def test_a_forked_worker_serves_leads_its_session_and_dies_by_its_signal(tmp_path: Path, redis_client,  # type: ignore[no-untyped-def]
                                                                         redis_server) -> None:
    zygotes = Zygotes()
    fleet = Fleet(tmp_path, redis_server.connection_url + "/0", None, zygotes)
    try:
        fleet.start_simulator()
        proc = fleet.start_worker("w1", concurrency=5)
        fleet.wait_ready("w1")
        assert proc.poll() is None
        assert os.getsid(proc.pid) == proc.pid  # stop_all ends its group, as with start_new_session
        assert "w1@" in fleet.log("w1")  # celery's own banner: it runs celery's main
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        # One that outlives its zygote (the session's teardown order) is still waited for.
        second = fleet.start_worker("w2", concurrency=5)
        fleet.wait_ready("w2")
        zygotes.close()
        assert second.poll() is None
        os.kill(second.pid, signal.SIGKILL)
        assert second.wait(timeout=30) == -signal.SIGKILL
    finally:
        fleet.stop_all()
        zygotes.close()
