"""REDIS_URL naming Sentinels: the URL form, and a failover mid-run that loses nothing.

The failover tests run a real deployment (tests/sentinel_cluster.py: a Valkey master and replica
with AOF, three ``redis-server --sentinel``), a real fleet on it (simulator, two gevent workers,
the producer, every one given the same ``sentinel://`` REDIS_URL), and SIGKILL the master.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu.transport import redis as kombu_redis

from common.celeryconf import celery_config
from common.errors import ConfigError
from common.redis_client import connect, fence_command
from common.redis_url import parse
from common.settings import Settings
from tests.fleet import Fleet, read_summary
from tests.sentinel_cluster import SentinelCluster

URL = "sentinel://:s%40cret@h1:26379;sentinel://h2:26380;sentinel://h3/2?master_name=mymaster"


# --- the URL --------------------------------------------------------------------------------


def test_a_sentinel_url_names_every_sentinel_the_master_the_db_and_the_password() -> None:
    target = parse(URL)
    assert target.is_sentinel
    assert target.sentinels == (("h1", 26379), ("h2", 26380), ("h3", 26379))
    assert (target.master_name, target.db, target.password, target.sentinel_password) == ("mymaster", 2, "s@cret", None)
    assert "s@cret" not in repr(target) and "cret" not in target.describe()
    assert target.describe() == "master 'mymaster' via Sentinel h1:26379,h2:26380,h3:26379 db 2"
    # kombu's own form: the list without our option, the password (quoted) and the db on the first.
    assert target.broker_url() == "sentinel://:s%40cret@h1:26379/2;sentinel://h2:26380/2;sentinel://h3:26379/2"
    with_own = parse("sentinel://u:pw@h1;sentinel://h2/0?master_name=m&sentinel_password=sp")
    assert (with_own.username, with_own.password, with_own.sentinel_password) == ("u", "pw", "sp")
    assert with_own.transport_options()["sentinel_kwargs"]["password"] == "sp"


def test_a_plain_url_passes_through_unchanged() -> None:
    for url in ("redis://:pw@h:6379/3", "rediss://h:6380/0", "unix:///run/redis.sock?db=1"):
        target = parse(url)
        assert not target.is_sentinel and target.broker_url() == url and target.transport_options() == {}


@pytest.mark.parametrize(("url", "says"), [
    ("sentinel://h1:26379;sentinel://h2:26379", "needs the master's name"),
    ("sentinel://h1:26379?master=m", "unknown option 'master'"),
    ("sentinel://h1:port?master_name=m", "the port is not a number"),
    ("sentinel://h1:26379/x?master_name=m", "the database 'x' is not a number"),
    ("sentinel://h1:26379/1;sentinel://h2/2?master_name=m", "part 2 gives another db"),
    ("sentinel://:a@h1;sentinel://:b@h2?master_name=m", "the passwords differ"),
    ("sentinel://h1;h2:26379?master_name=m", "part 2 (h2:26379?master_name=m) does not start with sentinel://"),
    ("sentinel://?master_name=m", "names no Sentinel host"),
    ("sentinels://h1?master_name=m", "TLS"),
    ("http://h1:6379", "expected redis://, rediss://, unix:// or sentinel://"),
])
def test_a_bad_url_names_the_variable_and_what_is_wrong_and_never_the_password(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({"REDIS_URL": url})
    message = str(caught.value)
    assert message.startswith("environment variable REDIS_URL: "), message
    assert says in message, message
    assert ":a@" not in message and ":b@" not in message


def test_celery_gets_kombus_sentinel_form_and_flowers_broker_view_the_same() -> None:
    conf = celery_config(Settings.from_env({}), URL)
    assert conf["broker_url"].startswith("sentinel://:s%40cret@h1:26379/2;")
    options = conf["broker_transport_options"]
    assert options["master_name"] == "mymaster"  # kombu's SentinelChannel and Flower's RedisSentinel
    assert options["visibility_timeout"] == 7200  # and everything a plain URL gets
    assert "master_name" not in celery_config(Settings.from_env({}), "redis://h:6379/0")["broker_transport_options"]


def test_the_workers_kombu_patches_apply_to_the_sentinel_channel_too() -> None:
    """workers/transport.py patches ``kombu.transport.redis.Channel`` (and its QoS and poller);
    ``SentinelChannel`` subclasses it and must not override a patched method, or a Sentinel worker
    would run kombu's own code there."""
    assert issubclass(kombu_redis.SentinelChannel, kombu_redis.Channel)
    for name in ("_create_client", "_brpop_start", "_brpop_read", "_basic_cancel"):
        assert name not in kombu_redis.SentinelChannel.__dict__, name
    assert kombu_redis.SentinelChannel.QoS is kombu_redis.QoS
    assert kombu_redis.SentinelTransport.__mro__[1] is kombu_redis.Transport
    assert "cycle" not in kombu_redis.SentinelTransport.__dict__  # the same MultiChannelPoller


# --- a real deployment ----------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    root = tmp_path / "sentinel"
    root.mkdir()
    deployment = SentinelCluster(root)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


def test_a_fence_behind_sentinel_waits_for_the_replicas_aof_while_one_is_online(cluster: SentinelCluster) -> None:
    client = connect(cluster.url, 30)
    pipe = client.pipeline(transaction=False)
    pipe.set("k", "v")
    pipe.execute_command(*fence_command(pipe))
    assert pipe.execute()[-1] == [1, 1]  # the master's AOF and the replica's
    cluster.kill_master()
    # The replica, promoted, is alone: the fence asks for its own AOF only, and answers at once.
    cluster.wait_until(lambda: cluster.master_port() == cluster.data_ports[1], 60, "the replica is promoted")
    client.set("k2", "v2")
    time.sleep(1.1)  # the replica count is re-read at most every second
    pipe = client.pipeline(transaction=False)
    pipe.set("k3", "v3")
    pipe.execute_command(*fence_command(pipe))
    assert pipe.execute()[-1] == [1, 0]
    assert client.get("k") == b"v"  # the fenced write survived the failover


def test_a_connection_that_lost_the_old_master_sends_its_next_command_to_the_new_one(
    cluster: SentinelCluster,
) -> None:
    """A command sent on a disconnected connection (a pipeline, the retry of a command that met the
    master's death) must ask the Sentinels again, not retry the dead master for the whole window."""
    client = connect(cluster.url, 30)
    conn = client.connection_pool.get_connection()
    conn.send_command("PING")
    assert conn.read_response() in (b"PONG", "PONG", True)
    old = cluster.kill_master()
    cluster.wait_until(lambda: cluster.master_port() not in (None, old), 60, "a replica is promoted")
    conn.disconnect()
    conn.send_command("SET", "after", "failover")  # reconnects through send_packed_command
    assert conn.read_response() in (b"OK", "OK", True)
    assert conn.port == cluster.master_port() != old
    client.connection_pool.release(conn)
    assert client.get("after") == b"failover"


def _rows(client: redis.Redis, dataset: str) -> int:
    from common.budget import Budget

    try:
        return Budget(client, dataset).snapshot().rows
    except redis.RedisError:
        return 0


@pytest.mark.fleet
def test_a_failover_mid_run_loses_nothing(tmp_path: Path, cluster: SentinelCluster,
                                          request: pytest.FixtureRequest) -> None:
    fleet = Fleet(tmp_path, cluster.url)
    try:
        _failover_run(fleet, cluster)
    except BaseException:
        print(fleet.all_logs())
        print(cluster.logs())
        raise
    finally:
        fleet.stop_all()


PROMPTS = 400


def _failover_run(fleet: Fleet, cluster: SentinelCluster) -> None:
    fleet.start_simulator("--latency-median-ms", "400")
    config = fleet.one_dataset("F", PROMPTS)
    fleet.start_worker("w1", concurrency=25)
    fleet.start_worker("w2", concurrency=25)
    producer = fleet.start_producer(config)
    client = connect(cluster.url, 120)
    cluster.wait_until(lambda: _rows(client, "F") >= 60, 120, "60 rows before the kill")
    at_kill = _rows(client, "F")
    old = cluster.kill_master()
    killed = time.monotonic()
    assert producer.poll() is None
    promoted_s = cluster.wait_until(lambda: cluster.master_port() not in (None, old), 60, "a replica is promoted")
    on_new = _rows(client, "F")  # what the promoted replica has (settles under way may add a few)
    resumed_s = promoted_s + cluster.wait_until(lambda: _rows(client, "F") > on_new + 10, 120,
                                                "the fleet keeping rows on the new master")
    assert producer.wait(timeout=240) == 0, "producer failed"
    print(f"failover: killed the master at {at_kill} of {PROMPTS} rows; a replica promoted after "
          f"{promoted_s:.1f} s ({on_new} rows on it), 10 more rows after {resumed_s:.1f} s, the run ended "
          f"{time.monotonic() - killed:.1f} s after the kill")
    log = fleet.log("producer")
    assert "Traceback" not in log
    assert "Redis unreachable, retrying" in log  # the producer met the failover and rode it out
    rows = fleet.assert_exactly_once(client, "F", PROMPTS)  # every prompt ended once, as a row
    summary = read_summary(fleet.out, "F")
    assert summary["failed"] == 0 and summary["results"] + summary["failed"] == PROMPTS, summary
    # No paid answer dropped: the simulator billed each prompt once, and each billed answer is a row.
    stats = fleet.sim_stats()
    assert stats["requests"] == PROMPTS, stats
    assert stats["billed_requests"] == PROMPTS == len(rows), stats
    assert summary["billed_completion_tokens"] == stats["billed_completion_tokens"], (summary, stats)
