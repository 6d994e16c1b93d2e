"""The worker's heap and Python's cyclic garbage collector.

A worker holds ~150k long-lived objects (Celery, kombu, transformers, the tokenizer) and makes a
few thousand short-lived ones per task. Python's collector walks every tracked object on each full
collection (~100 ms per pass on the 2-core box), and the youngest generation, sized for small
programs, is collected every 700 allocations. Measured on the 300 ms side-by-side bench
(``bench/versus_seed.py --fleet-only``, a gc callback timing each pass from the worker's start):
3.1–3.8 s of collections per worker over a 6,000-prompt run (gen 2: 6 passes, 1.5–1.7 s); with
this, 0.9–1.2 s, and the workers' CPU per row 5% lower (mean of four interleaved runs each).

So once the long-lived objects exist (the worker is up; a run's tokenizer is loaded), they are
moved out of the collector's sight (``gc.freeze``: they are still freed by reference counting,
only cycles among them are never looked for), and the youngest generation is collected less
often: a task's garbage is freed by reference counting all but entirely, the collector only finds
the odd cycle (a traceback, a greenlet's frame).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

#: Allocations (net of frees) between two collections of the youngest generation (CPython: 700).
YOUNG_THRESHOLD = 20_000


def settle_long_lived(why: str) -> None:
    """Collect once, then keep what is alive now out of every later collection."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    log.info("heap: %d objects frozen out of the collector (%s)", gc.get_freeze_count(), why)
