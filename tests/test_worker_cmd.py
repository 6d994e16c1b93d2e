"""What a Celery user expects of a specfleet worker: a stable node name, one command line for every
launcher, and queues it was given that are not specfleet's own left alone."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import redis

from common.settings import Settings
from common.worker_cmd import worker_argv
from producer.celery_app import make_app
from tests.fleet import Fleet

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


def _node(argv: list[str]) -> str:
    return argv[argv.index("-n") + 1]


def test_node_names_are_stable_and_numbered_only_when_several_share_a_host() -> None:
    assert _node(worker_argv(10)) == _node(worker_argv(10)) == "specfleet@%h"
    assert [_node(worker_argv(10, index=i)) for i in (1, 2)] == ["specfleet-1@%h", "specfleet-2@%h"]
    for theirs in (["-n", "mine@%h"], ["-nmine@%h"], ["--hostname", "mine@%h"], ["--hostname=mine@%h"]):
        argv = worker_argv(10, extra=theirs)
        assert "specfleet@%h" not in argv and argv[-len(theirs):] == theirs  # the user's name wins


def test_the_cli_and_the_demo_start_the_same_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from producer import cli, demo

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("SPECFLEET_CONCURRENCY", "7")
    execd: list[str] = []
    monkeypatch.setattr(os, "execvp", lambda _file, args: execd.extend(args))
    cli.main(["worker", "-l", "debug"])
    assert execd == worker_argv(7, extra=["-l", "debug"])

    started: list[list[str]] = []
    monkeypatch.setattr(demo.subprocess, "Popen", lambda cmd, **_: started.append(cmd))
    demo.start_worker(2, {}, 7, Path(os.devnull))
    assert started == [worker_argv(7, index=2)]


@pytest.mark.fleet
def test_workers_leave_queues_without_the_specfleet_prefix_alone(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("Q", 30)
    # `specfleet worker -Q other`: no -n, so the default node name.
    fleet.start_worker("w", concurrency=10, celery_args=("-Q", "other"))
    app = make_app(Settings.from_env({}), fleet.redis_url)
    node = f"specfleet@{socket.gethostname()}"
    deadline = time.monotonic() + 60
    while not app.control.ping(destination=[node], timeout=0.5):
        assert time.monotonic() < deadline, fleet.all_logs()
    app.control.add_consumer("added", destination=[node], reply=True, timeout=5)

    fleet.run_producer(config)  # the worker follows specfleet.q.Q, then leaves it
    fleet.assert_exactly_once(redis_client, "Q", 30)

    def consumed() -> set[str]:
        replies = app.control.inspect(destination=[node], timeout=2).active_queues() or {}
        return {q["name"] for q in replies.get(node, [])}

    # Several polls (SPECFLEET_QUEUE_POLL_S=0.3) after the run: what the worker consumes now stays.
    time.sleep(2.0)
    assert consumed() == {"other", "added"}, fleet.log("w")
    assert "left specfleet.q.Q" in fleet.log("w")
