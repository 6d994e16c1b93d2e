"""The queue window: a dataset's prompts reach Redis a window at a time, not all at once.

Every prompt is still one Celery task on its dataset's queue, but the producer keeps only a window
of them queued and refills it on each tick of the runner (every 0.25 s) as workers take them, reading
the file as a stream. Redis then holds the window plus what workers have taken (their unacked
messages, bounded by the fleet's in-flight size), never the dataset.

The window is bounded twice (``WindowBounds``, ``SPECFLEET_QUEUE_WINDOW_PROMPTS`` / ``_BYTES``):

- prompts (default 8,000): four times a 2,000-in-flight fleet's share, so a fleet that takes its whole
  share between two refills still finds the queue full; a bigger fleet wants a bigger window.
- bytes (default 64 MiB): the queued messages' size, estimated from the mean size of the messages
  pushed so far (the first batch is small, so an unknown size cannot overshoot); a dataset of large
  prompts gets fewer of them queued. A single message larger than the bound still goes, alone.

``PromptStream`` is one read of the file, taken a batch at a time; it counts the file as it goes
(the run's ``prompts``: what "every prompt has an outcome" compares against). When admission ends
before the end of the file (a budget stop), the rest is counted in a thread, so the next dataset
starts at once. A sweep or a top-up round reads the file again from its start, through a window of
its own, skipping prompts with an outcome (and, for a sweep, those that failed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from common.config import DatasetConfig
from common.datasets import Prompt, ReadStats, read_prompts
from common.errors import DatasetRowError
from common.prompt_filter import RunFilter
from common.settings import Settings

#: The first batch of a window, before any message size is known: small, so a dataset of huge prompts
#: cannot put a thousand of them in Redis before the byte bound knows their size.
FIRST_BATCH = 100


@dataclass(frozen=True)
class WindowBounds:
    prompts: int = Settings.queue_window_prompts
    bytes: int = Settings.queue_window_bytes


class PromptStream:
    """One streamed read of a dataset's file (up to ``max_prompts``), taken a batch at a time."""

    def __init__(self, ds: DatasetConfig, prompt_filter: RunFilter | None = None) -> None:
        """``prompt_filter``: the run's duplicates and eval leaks, left out of the read."""
        self.errors: list[DatasetRowError] = []
        self.stats = ReadStats()
        #: Prompts left out as eval leaks, each naming the eval item (``excluded.jsonl``).
        self.excluded: list[dict[str, Any]] = []
        if prompt_filter is not None:
            self._prompts = prompt_filter.read(ds, self.errors, self.stats, on_excluded=self.excluded.append)
        else:
            self._prompts = read_prompts(ds.path, self.errors, self.stats, limit=ds.max_prompts,
                                         max_line_bytes=ds.max_line_bytes)
        self._lock = threading.Lock()
        #: The file was read to its end (or to max_prompts): ``stats`` counts all of it.
        self.exhausted = False
        #: The rest is being counted in a thread (``count_rest_in_background``).
        self.counting = False

    def take(self, n: int) -> list[Prompt]:
        with self._lock:
            batch = list(islice(self._prompts, n))
            if len(batch) < n:
                self.exhausted = True
            return batch

    def count_rest_in_background(self) -> None:
        """Read the rest for its counts only (the report's prompts and malformed rows), in a thread."""
        self.counting = True

        def rest() -> None:
            with self._lock:
                for _ in self._prompts:
                    pass
                self.exhausted = True
        threading.Thread(target=rest, name="count-rest", daemon=True).start()


@dataclass
class QueueWindow:
    """A read of the file being queued through the window; ``skip``: ids not to queue (a sweep's failures)."""

    stream: PromptStream
    bounds: WindowBounds
    seal_key: bytes
    skip: frozenset[str] = frozenset()
    pushed: int = 0
    pushed_bytes: int = 0
    #: Prompts read and not queued (an outcome already, or skipped).
    passed: int = field(default=0)
    #: A sweep's window names the prompts it queues again (the first ones), so a lost message can be traced.
    sweep: bool = False

    def room(self, queued: int) -> int:
        """How many more prompts the window takes with ``queued`` in the queue."""
        if not self.pushed:
            return max(0, min(FIRST_BATCH, self.bounds.prompts) - queued)
        mean_bytes = self.pushed_bytes / self.pushed
        cap = min(self.bounds.prompts, int(self.bounds.bytes // mean_bytes))
        return max(0, max(cap, 1) - queued)

    def record(self, read: int, messages: int, size_bytes: int) -> None:
        self.pushed += messages
        self.pushed_bytes += size_bytes
        self.passed += read - messages


@dataclass
class Feed:
    """A dataset's prompts on their way to its queue: the first read of its file (which counts it),
    the window queued now (the first read's, or a sweep's or top-up's own read), and whether the
    file's counts are in. The run's phase says whether it is fed; this says how far the feeding is."""

    #: The first read of the file, which counts it (``prompts``, ``malformed``) as it is queued.
    first: PromptStream | None = None
    #: The read being queued now; None once admission ended (or a top-up found nothing to queue).
    window: QueueWindow | None = None
    #: The file's counts are in (read to its end, or the dataset skipped before any read).
    counted: bool = False

    def open(self, window: QueueWindow) -> None:
        """Queue through ``window`` from now on; the first one opened is the file's count."""
        if self.first is None:
            self.first = window.stream
        self.window = window

    def close(self) -> None:
        """Nothing more is queued: admission ended (the rest of the file is counted, see ``count_rest``)."""
        self.window = None

    @property
    def queuing(self) -> bool:
        """A window is open with prompts of its read still to take."""
        return self.window is not None and not self.window.stream.exhausted

    def count_rest(self) -> None:
        """The first read stopped before the file's end (admission ended): the rest counted in a thread."""
        if self.first is not None and not (self.first.exhausted or self.first.counting):
            self.first.count_rest_in_background()

    def counts_due(self) -> PromptStream | None:
        """The first read, once it has reached the file's end and its counts are not taken yet."""
        if self.counted or self.first is None or not self.first.exhausted:
            return None
        return self.first
