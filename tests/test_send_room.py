"""A worker takes the prompts it can send, not what its pool could hold (workers/fleet/send_room.py).

The count on its own (tasks in greenlets, a clock the test moves), then on a real fleet: a worker
that starts a run alone leaves in the queue what its request slots cannot take, and a second worker
sends it at once instead of the first worker's prompts waiting for its own slots.
"""

from __future__ import annotations

import statistics
import time

import gevent
import gevent.event
import pytest
import redis

from common import keys
from tests.fleet import Fleet
from workers.fleet.send_room import LOOKAHEAD_S, SendRoom


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _deliver(room: SendRoom, n: int) -> dict[str, str]:
    tags = {f"tag{i}": f"task{i}" for i in range(n)}
    for tag, task in tags.items():
        room.delivered(task, tag)
    return tags


def test_a_worker_takes_as_many_as_it_may_have_in_flight_until_requests_end() -> None:
    room = SendRoom(4, clock=Clock())
    assert room.room(set(), 0) == 4
    tags = _deliver(room, 4)
    assert room.room(set(tags), 4) == 0


def test_a_task_done_with_the_upstream_gives_its_place_back_and_its_ack_keeps_it_given() -> None:
    clock = Clock()
    room = SendRoom(2, clock=clock)
    tags = _deliver(room, 2)
    held = set(tags)
    inside = gevent.event.Event()
    leave = gevent.event.Event()

    def task(task_id: str) -> None:
        with room.task(task_id):
            with room.requesting():
                inside.set()
                leave.wait()
            gevent.sleep(0)  # rebuilding, settling: past its request

    g = gevent.spawn(task, "task0")
    inside.wait()
    assert room.room(held, 2) == 0  # in its request: its place is taken
    leave.set()
    g.join()
    # Its request ended (and counts towards the lookahead); its message waits for the ack.
    assert room.room(held, 2) == 1 + 1
    room.acked("task0", "tag0")
    held.discard("tag0")
    assert room.room(held, 1) == 1 + 1
    clock.now += LOOKAHEAD_S + 0.01
    assert room.room(held, 1) == 1  # the lookahead is the last second's endings, no more


def test_a_retry_takes_its_place_again_and_a_parked_delivery_gives_it_up() -> None:
    room = SendRoom(1, clock=Clock())
    tags = _deliver(room, 1)
    seen: list[int] = []

    def task() -> None:
        with room.task("task0"):
            with room.requesting():
                pass
            seen.append(room.room(set(tags), 1) - room.lookahead())  # backing off: not in a request
            with room.requesting():
                seen.append(room.room(set(tags), 1) - room.lookahead())
            with room.parked():
                seen.append(room.room(set(tags), 1) - room.lookahead())
            seen.append(room.room(set(tags), 1) - room.lookahead())  # out of the park: its place again

    gevent.spawn(task).join()
    assert seen == [1, 0, 1, 0]


def test_the_waiting_consumer_is_woken_once_when_room_opens() -> None:
    room = SendRoom(1, clock=Clock())
    tags = _deliver(room, 1)
    wakes: list[int] = []
    room.on_open = lambda: wakes.append(1)
    room.consumer_waiting = True

    def task() -> None:
        with room.task("task0"), room.requesting():
            pass

    gevent.spawn(task).join()
    assert wakes == [1]  # the request ended: one wake-up, then the consumer is no longer waiting
    room.acked("task0", next(iter(tags)))
    assert wakes == [1]


def test_marks_of_greenlets_that_are_not_tasks_count_for_nothing() -> None:
    room = SendRoom(3, clock=Clock())
    with room.requesting():
        pass
    with room.parked():
        pass
    assert room.room(set(), 0) == 3


@pytest.mark.fleet
def test_a_worker_leaves_what_it_cannot_send_to_a_worker_that_can(fleet: Fleet, redis_client: redis.Redis) -> None:
    """Worker 1 (10 requests in flight, a pool of 12) starts a run of 20 alone: it takes 10 and
    leaves 10 queued, though its pool could hold 12; worker 2 joins and the provider sees all 20
    in flight before any answer is back. Taking as many as its pool holds, worker 1 kept 2 waiting
    for its own slots for a whole latency while worker 2 had free ones."""
    concurrency, n = 10, 20
    fleet.start_simulator("--latency-median-ms", "30000", "--latency-p99-ms", "31000")
    config = fleet.one_dataset("R", n, timeout_s=90)
    fleet.start_worker("w1", concurrency=concurrency)
    producer = fleet.start_producer(config)
    queue = keys.queue("R")

    deadline = time.monotonic() + 60
    while fleet.sim_stats()["in_flight"] < concurrency:
        assert time.monotonic() < deadline, fleet.all_logs()
        time.sleep(0.1)
    time.sleep(1.0)  # room for a worker that over-takes to do so
    assert redis_client.llen(queue) == n - concurrency, fleet.all_logs()
    assert redis_client.hlen("unacked") == concurrency

    fleet.start_worker("w2", concurrency=concurrency)
    while fleet.sim_stats()["in_flight"] < n:
        assert fleet.sim_stats()["billed_requests"] == 0, "worker 2 sent its share only after answers came back"
        assert time.monotonic() < deadline + 30, fleet.all_logs()
        time.sleep(0.1)
    assert fleet.sim_stats()["max_in_flight"] == n
    producer.wait(timeout=120)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "R", n)


@pytest.mark.fleet
def test_a_worker_waiting_for_room_takes_the_next_prompts_as_soon_as_its_requests_end(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """Room opens only when a request ends (an ack gives back the place its task already gave),
    so every take after the first must follow an answer closely: the ending request wakes the
    consumer. Left to kombu, a consumer with no room looks again only when its poll times out
    (or when something else wakes it), and its takes lag the answers."""
    concurrency, n = 2, 20
    fleet.start_simulator("--latency-median-ms", "1500", "--latency-p99-ms", "1500")
    config = fleet.one_dataset("W", n, timeout_s=30)
    fleet.start_worker("w1", concurrency=concurrency)
    producer = fleet.start_producer(config)
    queue = keys.queue("W")

    lags: list[float] = []
    deadline = time.monotonic() + 120
    last_answer_at: float | None = None
    billed_before, queued_before = 0, None
    while producer.poll() is None:
        assert time.monotonic() < deadline, fleet.all_logs()
        billed, queued = fleet.sim_stats()["billed_requests"], redis_client.llen(queue)
        now = time.monotonic()
        if billed > billed_before:
            last_answer_at, billed_before = now, billed
        if queued_before is not None and queued < queued_before and last_answer_at is not None:
            lags.append(now - last_answer_at)  # a take: how long after the latest answer
        if queued_before is not None and queued == 0:
            break  # all taken
        if queued:
            queued_before = queued
        time.sleep(0.02)
    assert len(lags) >= 4, (lags, fleet.all_logs())
    # Measured: ~0.05 s with the wake-up, ~0.5 s without it (something else wakes kombu's poll
    # twice a second); the median stands a slow sample on a loaded machine.
    assert statistics.median(lags) < 0.25, lags
    assert producer.wait(timeout=120) == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "W", n)
