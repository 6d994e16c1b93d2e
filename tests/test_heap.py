"""The worker's heap: once its long-lived objects exist, the cyclic collector no longer walks them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.fleet import REPO


def test_settling_the_heap_takes_what_lives_now_out_of_every_collection_and_leaves_later_cycles_to_it() -> None:
    # In a child: a frozen heap would stay frozen for the rest of the test session.
    code = textwrap.dedent("""
        import gc, weakref
        from workers.fleet.heap import YOUNG_THRESHOLD, settle_long_lived

        class Node:
            pass

        long_lived = [Node() for _ in range(1000)]
        old_cycle = Node(); old_cycle.me = old_cycle; old_ref = weakref.ref(old_cycle)
        del old_cycle  # garbage before the settle: collected by it, not frozen
        settle_long_lived("test")
        assert old_ref() is None, "a cycle that was already garbage was frozen"
        assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(n) in tracked for n in long_lived), "a long-lived object is still walked"
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        new_cycle = Node(); new_cycle.me = new_cycle; new_ref = weakref.ref(new_cycle)
        del new_cycle
        gc.collect()
        assert new_ref() is None, "a cycle made after the settle is never collected"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
