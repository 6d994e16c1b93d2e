"""How many bytes of answers one worker turns into rows at once (``SPECFLEET_ANSWER_BYTES_IN_FLIGHT``).

An answer costs far more memory while it becomes a row than its bytes: measured with the demo
tokenizer, a 337 KB answer (300,000 characters, 201,000 tokens) peaks at ~60 MB over the
process's baseline (about 180 bytes per answer byte), 37 MB of it the tokenizer's own encoding
(Rust: the ids with a string, offsets and masks per token), the rest the row's id lists (~36 bytes
a token), the decode of the round-trip check and the packed row (870 KB). Rebuilt side by side in
the hub's thread pool, eight such answers took a worker 400 MB over its baseline, and each pool
thread's malloc arena kept its share after the answer was gone. Nothing the user set bounded it: a
worker with 1,000 requests in flight could meet 1,000 of them at once.

So an answer whose body is in waits here, in arrival order, until the answers being rebuilt and
settled hold fewer than the room's bytes with it; an answer larger than the whole room goes alone.
Its room is given back once its settle (or failure) is done, and a large answer's memory goes back
to the system then (``malloc_trim``), so the next large answer, on whichever pool thread, starts
from the baseline again. A task waiting here holds a paid answer: its keepalive renews the prompt's
lease so no other delivery asks again meanwhile, and never raises (a Redis blip must not cost the
answer). Waiting costs nothing at ordinary sizes: 4 MiB (the default) is 400 answers of 10 KB.

Together with ``SPECFLEET_MAX_ANSWER_BYTES`` (an answer over it is read and dropped, never kept
whole; ``workers/upstreams/openrouter.py``) a worker's memory for answers is about 180 × the room's bytes
(or × the largest answer, when one is larger than the room), plus the answers waiting for room
(parsed text: 1 to 4 bytes a character) and the bodies still arriving.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import gevent.event

from workers.upstreams.upstream import Answer

log = logging.getLogger(__name__)

#: How often a waiting answer's keepalive runs (the lease is renewed).
KEEPALIVE_EVERY_S = 5.0
#: An answer at least this large gives its memory back to the system when its room is released.
TRIM_MIN_BYTES = 64 * 1024


def answer_bytes(answer: Answer) -> int:
    """What an answer weighs here: its text, its tool calls' arguments and an engine's ids."""
    size = len(answer.reasoning or "") + len(answer.content or "")
    for call in answer.tool_calls or ():
        size += len(str(call.get("function") or ""))
    return size + 4 * (len(answer.completion_ids or ()) + len(answer.prompt_ids or ()))


class AnswerRoom:
    """One worker process's room, touched only from its hub's greenlets (no lock needed)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        self._queue: deque[tuple[int, gevent.event.Event]] = deque()

    @contextmanager
    def holding(self, size: int, *, keepalive: Callable[[], None] | None = None) -> Iterator[None]:
        """Wait for room for ``size`` bytes (running ``keepalive`` every KEEPALIVE_EVERY_S of waiting)
        and hold it for the block."""
        self._acquire(size, keepalive)
        try:
            yield
        finally:
            self.held_bytes -= size
            self._wake()
            if size >= TRIM_MIN_BYTES:
                release_memory()

    def _fits(self, size: int) -> bool:
        return self.held_bytes == 0 or self.held_bytes + size <= self.capacity_bytes

    def _acquire(self, size: int, keepalive: Callable[[], None] | None) -> None:
        if not self._queue and self._fits(size):
            self.held_bytes += size
            return
        entry = (size, gevent.event.Event())
        self._queue.append(entry)
        log.info("answer of %d bytes waits for room (%d of %d bytes held, %d waiting)",
                 size, self.held_bytes, self.capacity_bytes, len(self._queue))
        try:
            while not entry[1].wait(timeout=KEEPALIVE_EVERY_S):
                if keepalive is not None:
                    keepalive()
        except BaseException:
            if entry[1].is_set():  # the room came as we gave up: hand it on
                self.held_bytes -= size
            else:
                self._queue.remove(entry)
            self._wake()
            raise

    def _wake(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            size, granted = self._queue.popleft()
            self.held_bytes += size
            granted.set()


_libc: ctypes.CDLL | None = None
_no_trim = False


def release_memory() -> None:
    """Give the memory freed by a large answer back to the system (glibc ``malloc_trim``): the pool
    thread that rebuilt it keeps its own malloc arena, and would keep that answer's peak otherwise."""
    global _libc, _no_trim
    if _no_trim:
        return
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 - not glibc (musl, macOS): no trim
        except (OSError, AttributeError):
            _no_trim = True
            return
    with contextlib.suppress(Exception):
        _libc.malloc_trim(0)


_room: AnswerRoom | None = None


def answer_room(capacity_bytes: int) -> AnswerRoom:
    """This process's room (its size from the worker's settings, read once)."""
    global _room
    if _room is None or (_room.capacity_bytes != capacity_bytes and not _room.held_bytes):
        _room = AnswerRoom(capacity_bytes)
    return _room


__all__ = ["AnswerRoom", "answer_bytes", "answer_room", "release_memory"]
