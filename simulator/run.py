"""Running the simulator: as a process (``serve``) or on a background thread (``start_in_thread``).

A connection handler adds to each WSGI environ what WSGI cannot express: noticing that the
client has gone, and hanging up without an answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gevent
from gevent import pywsgi
from gevent import socket as gsocket

from simulator.requestlog import RequestLog
from simulator.server import CONNECTION_KEY, SimApp, SimState
from simulator.settings import SimSettings

log = logging.getLogger(__name__)

BACKLOG = 4096  # thousands of clients connect at once; the kernel caps it at somaxconn
STOP_TIMEOUT_S = 1.0  # hung requests are killed this long after stop()


class _Connection:
    """The client socket, for what WSGI cannot do: notice a client that left, or hang up."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def peer_gone(self) -> bool:
        raw = getattr(self._sock, "_sock", None)  # the non-blocking stdlib socket under gevent's
        if raw is None:
            return False
        try:
            return bool(raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"")
        except BlockingIOError:
            return False  # nothing to read: still connected
        except OSError:
            return True

    def drop(self) -> None:
        with contextlib.suppress(OSError):  # already gone: nothing to hang up
            self._sock.shutdown(socket.SHUT_RDWR)


class _Handler(pywsgi.WSGIHandler):
    def get_environ(self) -> dict[str, Any]:
        env: dict[str, Any] = super().get_environ()
        env[CONNECTION_KEY] = _Connection(self.socket)
        # OpenAI-compatible engines serve /v1/...: the same routes answer there as under /api/v1/...,
        # so a base URL of either layout (common/endpoints.py) can be tried against the simulator.
        path = env.get("PATH_INFO", "")
        if path.startswith("/v1/"):
            env["PATH_INFO"] = "/api" + path
        return env


def _listen(host: str, port: int) -> Any:
    """A listening gevent socket. Made in the thread whose hub will serve it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = gsocket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def make_server(state: SimState, listener: Any) -> pywsgi.WSGIServer:
    return pywsgi.WSGIServer(
        listener,
        RequestLog(SimApp(state)),
        handler_class=_Handler,
        log=None,  # our own one line per request replaces the access log
        error_log=pywsgi.LoggingLogAdapter(logging.getLogger(__name__ + ".wsgi")),
    )


def serve(settings: SimSettings) -> None:
    """Serve in this thread until SIGINT/SIGTERM."""
    state = SimState(settings)
    listener = _listen(settings.host, settings.port)
    server = make_server(state, listener)

    def stop() -> None:
        gevent.spawn(server.stop, timeout=STOP_TIMEOUT_S)

    gevent.signal_handler(signal.SIGTERM, stop)
    gevent.signal_handler(signal.SIGINT, stop)
    host, port = listener.getsockname()[:2]
    log.info("simulator listening on http://%s:%d (counting tokens with %s)",
             host, port, state.counter.name)
    server.serve_forever()


@dataclass
class SimHandle:
    """A simulator running in a background thread (see ``start_in_thread``)."""

    url: str  # http://host:port; the OpenRouter base URL is url + "/api/v1"
    _stop: Callable[[], None]

    @property
    def api_base(self) -> str:
        return self.url + "/api/v1"

    def stop(self) -> None:
        self._stop()

    def configure(self, **patch: Any) -> dict[str, Any]:
        """``POST /_sim/config`` with a partial update; returns the resulting settings."""
        return self._control("POST", "/_sim/config", patch)

    def stats(self, *, detail: bool = False) -> dict[str, Any]:
        return self._control("GET", "/_sim/stats" + ("?detail=1" if detail else ""))

    def reset(self) -> None:
        self._control("POST", "/_sim/reset", {})

    def _control(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def __enter__(self) -> SimHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(settings: SimSettings | None = None) -> SimHandle:
    """Start a simulator on its own thread and gevent hub (port 0 by default: a free port).
    For tests: the caller's thread needs no gevent and no monkey-patching."""
    settings = settings or SimSettings(port=0)
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        hub = gevent.get_hub()
        try:
            state = SimState(settings)  # loads the tokenizer: may fail
            listener = _listen(settings.host, settings.port)
            server = make_server(state, listener)
            server.start()
        except BaseException as exc:  # reported to the caller below
            box["error"] = exc
            ready.set()
            hub.destroy(destroy_loop=True)
            return
        box.update(hub=hub, server=server, address=listener.getsockname()[:2])
        ready.set()
        server.serve_forever()
        hub.destroy(destroy_loop=True)

    thread = threading.Thread(target=run, name="simulator", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("simulator did not start within 10 s")
    if "error" in box:
        raise box["error"]
    host, port = box["address"]

    def stop() -> None:
        if not thread.is_alive():
            return
        server = box["server"]
        box["hub"].loop.run_callback_threadsafe(
            lambda: gevent.spawn(server.stop, timeout=STOP_TIMEOUT_S))
        thread.join(10)

    shown = f"[{host}]" if ":" in host else host
    return SimHandle(url=f"http://{shown}:{port}", _stop=stop)
