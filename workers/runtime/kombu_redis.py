"""kombu Redis-transport patches for a gevent worker with 1,000 greenlets (fenced: ``PATCHES``).

Each replaced kombu method is declared in ``PATCHES`` with the kombu it was verified on and the
fingerprint of its source there; ``install`` refuses (``PatchDrift``) before patching anything if
the installed kombu's source differs (common/runtime.py).

- **One client per channel instead of one per ack.** kombu's Redis channel builds a new
  ``redis.Redis`` object (which copies redis-py's table of ~250 response callbacks) for every
  ``QoS.append`` and every ack: 2.4% of a busy worker's main thread. The object only borrows
  connections from the channel's pool per command, so one per pool is safe to share between
  greenlets; the asynchronous client (the BRPOP loop's own connection) is left alone.
- **A new queue is consumed at once.** kombu adds a queue to its BRPOP only when the running BRPOP
  times out (up to 1 s): on every dataset start, every worker idled that long. The BRPOP
  connection's server-side id is read once per socket (``CLIENT ID``), so ``wake_consumer`` can end
  the wait with ``CLIENT UNBLOCK`` (the BRPOP returns empty, as on its timeout, and kombu starts
  over with the new queue list). Without the id (no CLIENT command allowed) it waits, as before.
- **Messages waiting behind a BRPOP come in one call.** kombu takes one message per BRPOP and
  then records it as unacked in a pipeline of its own: two round trips per message, 12% of a busy
  worker. After a BRPOP delivered one, ``POP_MANY`` moves up to ``POP_BATCH`` more (within the
  prefetch room) from the same queues into the unacked hash and its index, in one script, and
  they are delivered as BRPOP's would be (kombu's ``QoS.append`` skips its own write for them).
  The unacked record is exactly kombu's (``[payload, exchange, routing_key]``, scored by time),
  so visibility-timeout restores and restores at channel close treat them alike; being written in
  the same step as the pop, no crash can lose a message between the two.
- **Acks of the moment share a round trip.** A late ack is a pipeline of its own per task. An ack
  waits up to ``ACK_LINGER_S`` for others; one pipeline removes them all from the unacked hash and
  its index, then each returns, as kombu's would, once its message is gone from there (so a task
  still ends only after its ack, and a warm shutdown waits for it). The wait holds the finished
  task's greenlet, not a row. Only in a gevent worker; elsewhere kombu's own ack.
- **A message is taken only when it can be sent soon.** In a worker (``install(room)``), kombu's
  prefetch check also asks the send room (``workers/fleet/send_room.py``), and a task leaving its request
  wakes a consumer that found no room through a pipe registered in kombu's poller; kombu would
  notice only when its poll next returned (~0.5 s later, measured).

- **A late cancel leaves a queue consumed again alone.** kombu puts off a cancel asked for while
  its poller reads (celery/celery#1773) until that read ends. Under gevent a timer greenlet (the
  active-queue poll) cancels while the consumer's greenlet sits in that read, and the read can
  deliver the broadcast that consumes the queue again, under a new tag: the late cancel then took
  the new consumer's callback and left the queue in the BRPOP, and the worker requeued every
  message of it to itself, forever ("No consumers"; seen after a halt and a resume a second
  apart). Now such a cancel only forgets its own tag.

- **A message is checked before kombu reads it** (``install(admit=…)``, workers/fleet/poison.py): kombu
  parses what BRPOP returns inside its read, and a message that is not a task's envelope (a JSON
  list, stray bytes) raised there and ended the worker ("Unrecoverable error"). Here the BRPOP's
  reply, and each message the multi-pop took, is handed to ``admit`` first; one it refuses is moved
  to the dead-letter list (with its unacked record, for the multi-pop's) and never delivered.

- **Redis refusing writes is waited out** (workers/fleet/writes.py): kombu writes a message's unacked
  record right after its BRPOP, and on a full (noeviction) server that raised inside the read and
  ended the worker, the message lost with it; its restore after an empty poll did the same. A
  refused record keeps the message in memory (recorded once writes are back), a refused ack (or one
  Redis was away for) is sent again once Redis answers, no BRPOP starts while refused, and kombu's
  restore skips its turn.

Nothing else changes for a good message: the same pool, the same messages; only when they are taken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import gevent
import gevent.event
import gevent.monkey
import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.eventio import READ
from kombu.utils.json import loads

from common.redis_client import REFUSED_WRITES, UNREACHABLE
from common.runtime import Patch, check
from workers.fleet import queues, writes
from workers.fleet.send_room import SendRoom

log = logging.getLogger(__name__)

_ORIGINAL_CREATE_CLIENT = kombu_redis.Channel._create_client
_ORIGINAL_BRPOP_START = kombu_redis.Channel._brpop_start
_ORIGINAL_BRPOP_READ = kombu_redis.Channel._brpop_read
_ORIGINAL_QOS_APPEND = kombu_redis.QoS.append
_ORIGINAL_QOS_ACK = kombu_redis.QoS.ack
_ORIGINAL_CAN_CONSUME = kombu_redis.QoS.can_consume
_ORIGINAL_CAN_CONSUME_MAX = kombu_redis.QoS.can_consume_max_estimate
_ORIGINAL_POLL_START = kombu_redis.MultiChannelPoller.on_poll_start
_ORIGINAL_HANDLE_EVENT = kombu_redis.MultiChannelPoller.handle_event
_ORIGINAL_BASIC_CANCEL_NOW = kombu_redis.Channel._basic_cancel
_ORIGINAL_MAYBE_RESTORE = kombu_redis.MultiChannelPoller.maybe_restore_messages
_ORIGINAL_POLL_INIT = kombu_redis.MultiChannelPoller.on_poll_init

#: Checks a message read from a queue: its envelope to deliver, or None when it was moved aside
#: (workers/fleet/poison.py). Arguments: the raw message, its queue, and the unacked hash and index the
#: multi-pop already recorded it in (None for a BRPOP's message, recorded only once delivered).
Admit = Callable[..., "dict[str, Any] | None"]

#: The worker's send room, and the pipe that wakes its consumer (``install``).
_room: SendRoom | None = None
_admit: Admit | None = None
_wake_r = _wake_w = -1

#: How long an ack waits for others to share its round trip.
ACK_LINGER_S = 0.1

#: Messages taken per call after a BRPOP, at most (and never past the prefetch room).
POP_BATCH = 32

#: KEYS: unacked hash, unacked index, then the queues' lists in BRPOP's order; ARGV: how many at
#: most, the time to score them with. Returns [list, payload, list, payload, …]. A payload it
#: cannot read goes back where it was, for kombu's own path to deal with.
POP_MANY = """
local n, now, out = tonumber(ARGV[1]), ARGV[2], {}
for i = 3, #KEYS do
  while #out < 2 * n do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    local ok, msg = pcall(cjson.decode, item)
    local props = ok and type(msg) == 'table' and msg['properties']
    local info = type(props) == 'table' and props['delivery_info']
    if type(info) ~= 'table' or type(props['delivery_tag']) ~= 'string' then
      redis.call('RPUSH', KEYS[i], item)
      return out
    end
    redis.call('ZADD', KEYS[2], now, props['delivery_tag'])
    redis.call('HSET', KEYS[1], props['delivery_tag'],
               '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    out[#out + 1] = KEYS[i]
    out[#out + 1] = item
  end
end
return out
"""


def _create_client(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _ORIGINAL_CREATE_CLIENT(self, asynchronous)
    pool = self.pool
    cached = self.__dict__.get("_specfleet_client")
    if cached is None or cached.connection_pool is not pool:  # a reconnect made a new pool
        cached = self.__dict__["_specfleet_client"] = _ORIGINAL_CREATE_CLIENT(self, False)
    return cached


def _brpop_start(self: Any, timeout: Any = None) -> Any:
    conn = getattr(self.client, "connection", None)
    if conn is not None:
        try:
            if conn._sock is None:
                conn.connect()
            if self.__dict__.get("_specfleet_brpop_sock") is not conn._sock:
                conn.send_command("CLIENT", "ID")
                self.__dict__["_specfleet_brpop_id"] = int(conn.read_response())
                self.__dict__["_specfleet_brpop_sock"] = conn._sock
        except (redis.RedisError, OSError, ValueError, TypeError):
            self.__dict__.pop("_specfleet_brpop_id", None)  # kombu reconnects; we wait as before
    return _ORIGINAL_BRPOP_START(self, timeout)


def _brpop_read(self: Any, **options: Any) -> Any:
    try:
        if _admit is None:
            delivered = _ORIGINAL_BRPOP_READ(self, **options)  # raises Empty when the BRPOP timed out
        else:
            delivered = _checked_brpop_read(self, _admit, **options)
    except REFUSED_WRITES as exc:  # a replica refuses the pop itself: kombu would end the worker
        writes.refused(exc)
        raise Empty() from None
    if delivered:
        _deliver_waiting(self)
    return delivered


def _checked_brpop_read(self: Any, admit: Admit, **options: Any) -> bool:
    """kombu's ``_brpop_read``, with the message checked before kombu parses it: kombu's own
    ``loads`` and ``Message`` raise on a message that is not a task's envelope, and any exception
    there ends the worker ("Unrecoverable error") or its broker connection."""
    try:
        try:
            dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
        except self.connection_errors:
            self.client.connection.disconnect()  # as kombu: the next poll reconnects
            raise
        except AttributeError as exc:
            # redis-py reads from a connection another greenlet disconnected meanwhile (its buffer
            # is None: seen in make soak at a Redis SIGKILL): a lost connection, not a worker's end.
            self.client.connection.disconnect()
            raise redis.ConnectionError(f"connection closed during BRPOP ({exc})") from exc
        if not dest__item:
            raise Empty()
        dest, item = dest__item
        dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(dest)
        envelope = admit(item, dest)
        if envelope is not None:  # None: moved to the dead-letter list
            self.connection._deliver(envelope, dest)
        return True
    finally:
        self._in_poll = None
        flush = getattr(self, "_flush_brpop_reauth", None)  # kombu 5.7: a re-auth token waits for this moment
        if flush is not None:
            flush()


def _deliver_waiting(channel: Any) -> None:
    """Deliver the messages already waiting in the channel's queues, up to the prefetch room."""
    room = channel.qos.can_consume_max_estimate()
    n = POP_BATCH if room is None else min(POP_BATCH, room)
    queues = channel._queue_cycle.consume(len(channel.active_queues))
    if n <= 0 or not queues or channel.global_keyprefix:  # a prefix: kombu's own path, as before
        return
    keys = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps for queue in queues]
    try:
        with channel.conn_or_acquire() as client:
            script = channel.__dict__.get("_specfleet_pop_many")
            if script is None:
                script = channel.__dict__["_specfleet_pop_many"] = client.register_script(POP_MANY)
            reply = script(keys=[channel.unacked_key, channel.unacked_index_key, *keys], args=[n, repr(time.time())],
                           client=client)
    except REFUSED_WRITES as exc:  # the script pops nothing it cannot record
        writes.refused(exc)
        return
    except redis.RedisError as exc:  # whatever it popped is in the unacked hash: restored in time
        log.warning("cannot take waiting messages: %s", exc)
        return
    recorded = channel.qos.__dict__.setdefault("_specfleet_recorded", set())
    messages = []
    for key, item in zip(reply[::2], reply[1::2], strict=True):
        queue = key.decode().rsplit(channel.sep, 1)[0]
        if _admit is None:
            payload = loads(item)
        elif (payload := _admit(item, queue, (channel.unacked_key, channel.unacked_index_key))) is None:
            continue  # dead-lettered, and its unacked record with it
        recorded.add(payload["properties"]["delivery_tag"])
        messages.append((queue, payload))
    for queue, payload in messages:
        channel._queue_cycle.rotate(queue)
        channel.connection._deliver(payload, queue)


def _basic_cancel_now(self: Any, consumer_tag: Any) -> Any:
    queue = self._tag_to_queue.get(consumer_tag)
    if queue is None or not any(q == queue for t, q in self._tag_to_queue.items() if t != consumer_tag):
        return _ORIGINAL_BASIC_CANCEL_NOW(self, consumer_tag)
    # Consumed again under another tag since this cancel was asked for: forget this tag and the
    # queue's entry it added; the callback and the other entry are the new consumer's.
    del self._tag_to_queue[consumer_tag]
    self._consumers.discard(consumer_tag)
    with contextlib.suppress(ValueError):
        self._active_queues.remove(queue)
    self._update_queue_cycle()
    return None


def _qos_append(self: Any, message: Any, delivery_tag: Any) -> None:
    if _room is not None:
        _room.delivered(_task_id(message), delivery_tag)
    recorded = self.__dict__.get("_specfleet_recorded")
    if recorded and delivery_tag in recorded:  # POP_MANY wrote its unacked record already
        recorded.discard(delivery_tag)
        virtual.QoS.append(self, message, delivery_tag)
        return
    try:
        _ORIGINAL_QOS_APPEND(self, message, delivery_tag)
    except REFUSED_WRITES as exc:
        # The BRPOP took it already: raising here ended the worker and lost the message. It runs
        # (its task waits for writes like any other) and is recorded once Redis takes writes.
        writes.refused(exc)
        virtual.QoS.append(self, message, delivery_tag)
        _unrecorded.append((self, message, delivery_tag))


#: Messages delivered while Redis refused their unacked record: (qos, message, tag).
_unrecorded: list[tuple[Any, Any, Any]] = []
#: Acks Redis refused: (qos, tags), removed from the unacked record once writes are back.
_unremoved: list[tuple[Any, list[Any]]] = []


def _catch_up() -> None:
    """Writes are back: the unacked records and acks Redis refused meanwhile."""
    while _unrecorded:
        qos, message, tag = _unrecorded.pop()
        if tag in qos._delivered:  # not acked meanwhile
            try:
                _ORIGINAL_QOS_APPEND(qos, message, tag)
            except redis.RedisError as exc:  # refused again, or away: the task runs unrecorded
                log.warning("cannot record delivered message %s as unacked: %s", tag, exc)
    while _unremoved:
        qos, tags = _unremoved.pop()
        try:
            with qos.pipe_or_acquire() as pipe:
                pipe.zrem(qos.unacked_index_key, *tags).hdel(qos.unacked_key, *tags).execute()
        except redis.RedisError as exc:  # left to the visibility timeout: the done set answers it
            log.warning("cannot remove %d acked message(s) from unacked: %s", len(tags), exc)


class _Acks:
    """The acks of one round trip: their tags, and the moment they are done (or failed)."""

    __slots__ = ("done", "tags")

    def __init__(self) -> None:
        self.tags: list[Any] = []
        self.done: gevent.event.AsyncResult = gevent.event.AsyncResult()


def _task_id(message: Any) -> str | None:
    headers = getattr(message, "headers", None) or {}
    return headers.get("id")  # Celery's task id (message protocol 2)


def _qos_ack(self: Any, delivery_tag: Any) -> None:
    message = self._delivered.get(delivery_tag)
    try:
        _ack(self, delivery_tag)
    finally:
        if _room is not None:
            _room.acked(_task_id(message), delivery_tag)


def _ack(self: Any, delivery_tag: Any) -> None:
    if not gevent.monkey.is_module_patched("socket"):
        _ORIGINAL_QOS_ACK(self, delivery_tag)
        return
    acks = self.__dict__.get("_specfleet_acks")
    if acks is None:
        acks = self.__dict__["_specfleet_acks"] = _Acks()
        gevent.spawn_later(ACK_LINGER_S, _remove_acked, self, acks)
    acks.tags.append(delivery_tag)
    acks.done.get()  # raises what the round trip met, as kombu's own ack would
    virtual.QoS.ack(self, delivery_tag)


def _remove_acked(qos: Any, acks: _Acks) -> None:
    if qos.__dict__.get("_specfleet_acks") is acks:  # later acks start the next round trip
        del qos.__dict__["_specfleet_acks"]
    try:
        with qos.pipe_or_acquire() as pipe:
            pipe.zrem(qos.unacked_index_key, *acks.tags).hdel(qos.unacked_key, *acks.tags).execute()
    except (*REFUSED_WRITES, *UNREACHABLE) as exc:
        # The task is done: it ends; its record goes once Redis takes writes again (or, if this
        # worker stops first, the visibility timeout delivers the message again and the done set
        # answers it). Raised, it was a CRITICAL "Couldn't ack" and a traceback per task.
        if isinstance(exc, REFUSED_WRITES):
            writes.refused(exc)
        _unremoved.append((qos, list(acks.tags)))
        acks.done.set(None)
    except BaseException as exc:
        acks.done.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
    else:
        acks.done.set(None)
        if _unremoved:  # Redis answers again: the acks an outage kept
            gevent.spawn(_catch_up)


def _room_left(qos: Any) -> int:
    """What the send room lets this channel take now (installed only with a room)."""
    assert _room is not None
    return _room.room(qos._delivered, len(qos._delivered) - len(qos._dirty))


def _can_consume(self: Any) -> bool:
    # The room decides whether a BRPOP is sent, never whether one already sent is read: its message
    # left the queue and is in no unacked record until delivered, so a reply kombu held back for
    # room would be lost with the worker (seen in the soak: prompts found only by the idle sweep).
    in_flight_brpop = bool(getattr(self.channel, "_in_poll", False))
    # Nor a new one while Redis refuses writes: its message could not be recorded as unacked.
    able = bool(_ORIGINAL_CAN_CONSUME(self)) and (
        in_flight_brpop or (not writes.refusing() and _room_left(self) > 0))
    if not able:
        _room.consumer_waiting = True  # type: ignore[union-attr]
    return able


def _can_consume_max_estimate(self: Any) -> int | None:
    estimate: int | None = _ORIGINAL_CAN_CONSUME_MAX(self)
    room = max(0, _room_left(self))
    return room if estimate is None else min(estimate, room)


def _maybe_restore_messages(self: Any) -> Any:
    if writes.refusing():
        return None
    try:
        return _ORIGINAL_MAYBE_RESTORE(self)
    except REFUSED_WRITES as exc:  # kombu catches only connection errors here: the worker ended
        writes.refused(exc)
        return None


def _on_poll_init(self: Any, poller: Any) -> Any:
    try:
        return _ORIGINAL_POLL_INIT(self, poller)
    except REFUSED_WRITES as exc:  # its restore of unacked messages; the timer's comes later
        writes.refused(exc)
        return None


def _on_poll_start(self: Any) -> None:
    _ORIGINAL_POLL_START(self)
    if _wake_r >= 0 and self.__dict__.get("_specfleet_wake_poller") is not self.poller:
        self.poller.register(_wake_r, READ)
        self.__dict__["_specfleet_wake_poller"] = self.poller


def _handle_event(self: Any, fileno: int, event: int) -> Any:
    if fileno == _wake_r:  # room opened: the poll returns empty and kombu starts over, BRPOP included
        with contextlib.suppress(BlockingIOError):
            while os.read(_wake_r, 4096):
                pass
        return None
    return _ORIGINAL_HANDLE_EVENT(self, fileno, event)


def _wake() -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe: the consumer is woken already
        os.write(_wake_w, b"!")


def wake_consumer(channel: Any, client: redis.Redis) -> bool:
    """End ``channel``'s running BRPOP now, so it starts over with the queues just added; True
    when no BRPOP is waiting on the old list (ended now, or none running: the next one lists them)."""
    client_id = getattr(channel, "__dict__", {}).get("_specfleet_brpop_id")
    if client_id is None:
        return False
    if not getattr(channel, "_in_poll", None):
        # kombu's False or None: between two reads (a consumer just started, or handing out what
        # its last read brought); an UNBLOCK would find nothing to end (it answered 0 and the log
        # said "from the next poll" once in CI while the first request went out at once).
        return True
    # A BRPOP just sent may not be blocked at the server yet (UNBLOCK answers 0): asked once more
    # a moment later, while the consumer is still in that read.
    for attempt in range(2):
        with contextlib.suppress(redis.RedisError):
            if client.execute_command("CLIENT", "UNBLOCK", client_id):
                return True
        if attempt == 0:
            gevent.sleep(0.05)
            if not getattr(channel, "_in_poll", None):
                return True  # that read ended meanwhile: the next one lists the new queue
    return False


def install(room: SendRoom | None = None, admit: Admit | None = None) -> None:
    """Patch kombu in this process; with ``room``, a consumer takes messages as the room allows;
    with ``admit``, each message is checked before kombu reads it (see ``Admit``)."""
    global _room, _wake_r, _wake_w, _admit
    check(PATCHES)  # before any of them: all or none
    _admit = admit
    if room is not None:
        _room = room
        _wake_r, _wake_w = os.pipe()
        os.set_blocking(_wake_r, False)
        os.set_blocking(_wake_w, False)
        room.on_open = _wake
        writes.on_resume(_wake)
        setattr(kombu_redis.QoS, "can_consume", _can_consume)  # noqa: B010
        setattr(kombu_redis.QoS, "can_consume_max_estimate", _can_consume_max_estimate)  # noqa: B010
        setattr(kombu_redis.MultiChannelPoller, "on_poll_start", _on_poll_start)  # noqa: B010
        setattr(kombu_redis.MultiChannelPoller, "handle_event", _handle_event)  # noqa: B010
    # setattr: mypy forbids assigning to a method.
    setattr(kombu_redis.Channel, "_create_client", _create_client)  # noqa: B010
    setattr(kombu_redis.Channel, "_brpop_start", _brpop_start)  # noqa: B010
    setattr(kombu_redis.Channel, "_brpop_read", _brpop_read)  # noqa: B010
    setattr(kombu_redis.Channel, "_basic_cancel", _basic_cancel_now)  # noqa: B010
    setattr(kombu_redis.QoS, "append", _qos_append)  # noqa: B010
    setattr(kombu_redis.MultiChannelPoller, "maybe_restore_messages", _maybe_restore_messages)  # noqa: B010
    setattr(kombu_redis.MultiChannelPoller, "on_poll_init", _on_poll_init)  # noqa: B010
    writes.on_resume(_catch_up)
    queues.on_follow(wake_consumer)  # a queue followed is consumed now, not at the poll's next turn
    setattr(kombu_redis.QoS, "ack", _qos_ack)  # noqa: B010


_SEND_ROOM = ("A message is taken only when it can be sent soon: kombu's prefetch check also asks the send room "
              "(workers/fleet/send_room.py), and a task leaving its request wakes a consumer that found no room "
              "through a pipe registered in kombu's poller; kombu would notice only when its poll next returned "
              "(~0.5 s).")
_REFUSED = ("Redis refusing writes is waited out (workers/fleet/writes.py): on a full (noeviction) server or a "
            "replica, kombu raised inside its read or restore and ended the worker, the message lost with it.")


def _kombu(target: str, why: str, reason: str, replacement: str, fingerprint: str,
           upstream: str = "none filed") -> Patch:
    return Patch(target=f"kombu.transport.redis:{target}", dist="kombu", verified="5.7.0", fingerprint=fingerprint,
                 why=why, reason=reason, upstream=upstream, replacement=f"workers.runtime.kombu_redis:{replacement}")


#: Every kombu method this module replaces (the module docstring says each why at length).
PATCHES = (
    _kombu("Channel._create_client", "one client per channel instead of one per ack",
           "kombu builds a new redis.Redis (copying ~250 response callbacks) for every QoS.append and ack: 2.4% "
           "of a busy worker's main thread. One per pool is shared; the BRPOP loop's own client is left alone.",
           "_create_client",
           "6b81dc416d4e243ce27c3d90f1e47e9f06d7f2b1631a5e396595918486d2892b"),
    _kombu("Channel._brpop_start", "a new queue is consumed at once",
           "kombu adds a queue to its BRPOP only when the running one times out (up to 1 s); the BRPOP "
           "connection's CLIENT ID is read once per socket so wake_consumer can CLIENT UNBLOCK it.",
           "_brpop_start",
           "d1b05887a43db7d8bc0ef46651fc8a95c46a91a49c57bacbb44ce2f05739bbe7"),
    _kombu("Channel._brpop_read", "the multi-pop, the poison check and refused writes",
           "After a BRPOP delivered one message, POP_MANY takes up to POP_BATCH more in one script (kombu: two "
           "round trips per message, 12% of a busy worker); each message is checked by workers/fleet/poison.py before "
           "kombu parses it (one that is not a task's envelope ended the worker: 'Unrecoverable error'); a "
           "replica refusing the pop is waited out. " + _REFUSED,
           "_brpop_read",
           "dfd713e8c65cd60493d4471ec6e9f2d5f7365f7dddace4f8333094115cbce64d",
           upstream="none filed for Redis (the same crash on SQS: "
           "https://github.com/celery/kombu/issues/2421; https://github.com/celery/celery/issues/4308)"),
    _kombu("Channel._basic_cancel", "a late cancel leaves a queue consumed again alone",
           "kombu puts off a cancel asked for while its poller reads until that read ends; under gevent the read "
           "can deliver the broadcast that consumes the queue again under a new tag, and the late cancel took "
           "the new consumer's callback: the worker requeued every message of the queue to itself, forever.",
           "_basic_cancel_now",
           "1f5f6786028e03dd10855dd19079493d2fa7bf929812a43a33a03d5cb8e1a414", upstream="https://github.com/celery/celery/issues/1773"),
    _kombu("QoS.append", "the multi-pop's messages are recorded once; refused writes",
           "POP_MANY wrote the unacked record already (kombu's write is skipped for those); a record Redis "
           "refuses keeps the message in memory, recorded once writes are back; the send room hears of it.",
           "_qos_append",
           "deb496d226e23155c5a1dfe588c91b25d26338404b201ca9d49e89c266b878be"),
    _kombu("QoS.ack", "acks of the moment share a round trip",
           "A late ack is a pipeline of its own per task; here an ack waits up to ACK_LINGER_S for others and one "
           "pipeline removes them all. An ack Redis refused (or was away for) is sent again once it answers.",
           "_qos_ack",
           "e327206e27ae8803262812b349d9b2abff756c8ede52a5662f97f7db05ee4064"),
    _kombu("QoS.can_consume", "a message is taken only when it can be sent soon", _SEND_ROOM + " " + _REFUSED,
           "_can_consume",
           "d62fcf40edc2228b05722f120f838e27ee26042bc3e001bcde9e34bdd9990149"),
    _kombu("QoS.can_consume_max_estimate", "the prefetch room is also the send room's", _SEND_ROOM,
           "_can_consume_max_estimate",
           "786d5344492b763914d85bdacd4ec28feb56484998bb826e8227fd20539149c7"),
    _kombu("MultiChannelPoller.on_poll_start", "the send room's wake-up pipe is polled", _SEND_ROOM,
           "_on_poll_start",
           "7942846217955c13f23e587744b39bb11f58423079297f335d227b9f84350fbb"),
    _kombu("MultiChannelPoller.handle_event", "the send room's wake-up pipe is read", _SEND_ROOM,
           "_handle_event",
           "6a59639e051602ca11f585900ec2949fdaf1a254ac3b37ef4c8453e2545f70c4"),
    _kombu("MultiChannelPoller.maybe_restore_messages", "its restore waits while Redis refuses writes", _REFUSED,
           "_maybe_restore_messages",
           "f9a877fa075481bd30f71d64aeb464cf40b020965642d748bf78fc7f438af6be"),
    _kombu("MultiChannelPoller.on_poll_init", "its restore waits while Redis refuses writes", _REFUSED,
           "_on_poll_init",
           "eb833c235d4b08ffdb7a25ecddbee17f2b36957c48764933adf3f85f972a855b"),
)
