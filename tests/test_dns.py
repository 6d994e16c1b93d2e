"""workers/runtime/dns.py: greenlets asking for one name at once share one real lookup, kept for its TTL."""

from __future__ import annotations

import socket
from typing import Any

import pytest

gevent = pytest.importorskip("gevent")

from workers.runtime.dns import CachedLookup  # noqa: E402


def _counting(slow_s: float = 0.0) -> tuple[list[Any], Any]:
    calls: list[Any] = []

    def lookup(*args: Any) -> Any:
        calls.append(args)
        gevent.sleep(slow_s)  # a resolver answering later than the other greenlets ask
        return socket.getaddrinfo(*args)

    return calls, lookup


def test_greenlets_asking_at_once_share_one_lookup_and_its_answer() -> None:
    calls, lookup = _counting(slow_s=0.05)
    cached = CachedLookup(lookup)
    jobs = [gevent.spawn(cached, "localhost", 80, 0, socket.SOCK_STREAM) for _ in range(50)]
    gevent.joinall(jobs, timeout=10, raise_error=True)
    assert len(calls) == 1
    assert all(j.value == jobs[0].value for j in jobs) and jobs[0].value
    cached("localhost", 80, 0, socket.SOCK_STREAM)
    assert len(calls) == 1  # within the TTL: no new lookup
    cached("localhost", 443, 0, socket.SOCK_STREAM)
    assert len(calls) == 2  # another port is another question


def test_an_answer_expires_and_an_error_is_not_kept() -> None:
    calls, lookup = _counting()
    cached = CachedLookup(lookup, ttl_s=0.0)
    cached("localhost", 80)
    cached("localhost", 80)
    assert len(calls) == 2
    failing = CachedLookup(lambda *a: (_ for _ in ()).throw(socket.gaierror(-2, "Name or service not known")))
    for _ in range(2):
        with pytest.raises(socket.gaierror):
            failing("no-such-host.invalid", 80)
    assert failing.lookups == 2


def test_a_gevent_worker_process_looks_names_up_through_the_cache() -> None:
    import subprocess
    import sys

    code = ("from gevent import monkey; monkey.patch_all()\n"
            "import socket, workers.runtime.dns, workers.pipeline.task\n"
            "from workers.celery import app\n"
            "from workers.bootstrap import boot\n"
            "boot(app.settings, app)\n"
            "print(type(socket.getaddrinfo).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == "CachedLookup", out.stderr
