"""A fork server for the tests' producers and workers: a process that has imported the heavy
libraries once and forks a child per launch, which runs ``python -m <module> <args>`` as a fresh
interpreter would (``runpy``, its own session, environment, cwd and log).

On the 2-core test box CPU is what ``make test`` waits on, and most of a short producer run or a
worker start is imports: transformers alone is ~1.2 CPU-s (its package scan ~0.5 more on the first
``AutoTokenizer``), celery with gevent ~0.6, matplotlib ~0.5 — paid again by each of the ~100
producers and ~85 workers a run starts. Only libraries are imported ahead, never the project's
modules, so a child reads its settings, its environment and (in ``make mutants``) the code under
test as a process started by hand does.

A child differs from a fresh interpreter in what a fork shares, so a launch the zygote cannot make
alike is started the plain way (``Zygote.suits``): its hash seed is the zygote's, so a launch
that sets ``PYTHONHASHSEED`` is not forked. What the libraries and the interpreter read at start
(``HF_*``, ``TRANSFORMERS_*``, ``MPL*``, ``PYTHON*``…) is the zygote's too, so each such
environment gets a zygote of its own (``Zygotes.per_kind`` at most; past that, plain processes).

One zygote serves every test process of a run (the four of ``make test -n 4``): each is a client
of a unix socket in the run's directory (``RUN_DIR_ENV``, made by tests/conftest.py), named for
the zygote's kind and import environment. The first client to find no socket there starts the
zygote, under the directory's lock; the zygote ends once its last client has gone, under the same
lock, so a client never connects to one that is leaving.

Run as ``python -m harness.zygote KIND FD LOCK``: accepts clients on the listening unix socket
``FD`` (SOCK_SEQPACKET: one JSON request and the child's stdin, stdout and stderr fds per message;
replies ``{"pid"}`` per launch and ``{"exit", "code"}`` to the launching client per child that
ended, ``code`` as ``Popen.returncode`` gives it).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parent.parent

#: What each kind imports ahead: the libraries its module imports, never the project's own modules.
PRELOAD: dict[str, tuple[str, ...]] = {
    "producer": ("redis", "requests", "msgpack", "jinja2", "transformers.models.auto.tokenization_auto",
                 "tokenizers", "matplotlib.figure",
                 "matplotlib.backends.backend_agg", "matplotlib.ticker", "pyarrow", "pyarrow.parquet",
                 "zstandard", "celery", "kombu", "kombu.transport.redis"),
    "worker": ("celery.bin.celery", "celery.apps.worker", "celery.concurrency.gevent", "kombu.transport.redis",
               "redis", "requests", "msgpack", "jinja2", "transformers.models.auto.tokenization_auto",
               "tokenizers"),
}
#: The module each kind runs (``python -m``).
MODULE = {"producer": "producer.cli", "worker": "celery"}
#: Environment the preloaded libraries read at import; a launch must agree with the zygote on it.
#: (Not ``TOKENIZERS_PARALLELISM``: the Rust library reads it on each parallel call, never at import.)
IMPORT_ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "MPL", "GEVENT", "PYTHON", "CELERY_",
                       "FORKED_BY_MULTIPROCESSING")


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES)}


def forks_alike(env: dict[str, str]) -> bool:
    """Whether a child launched with ``env`` can be forked at all: not with a hash seed of its
    own, which a fork would leave the zygote's."""
    return "PYTHONHASHSEED" not in env


#: On which launch of an import environment its zygote starts (``Zygotes``).
AFTER = {"producer": 2, "worker": 1}
#: The run's directory of zygote sockets, shared by its test processes (tests/conftest.py sets it).
RUN_DIR_ENV = "HARNESS_ZYGOTE_DIR"
#: A zygote no client ever reached (its starter died before connecting) ends after this long.
FIRST_CLIENT_S = 60.0


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


# --- the zygote ---------------------------------------------------------------------------------


def _preload(kind: str) -> Callable[[], int]:
    """Import ``kind``'s libraries; returns the fork the zygote must call."""
    fork = os.fork
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as common/hf.py does
    if kind == "worker":
        # As celery's own ``python -m celery ... -P gevent`` does before importing anything else.
        import celery

        celery.maybe_patch_concurrency(["celery", "-P", "gevent"])
        from gevent import monkey

        # The zygote's own loop must not run a gevent hub it would hand to every child.
        fork = monkey.get_original("os", "fork")
    for name in PRELOAD[kind]:
        # An optional library not installed: the child imports it (or not) itself.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return fork


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(kind: str, request: dict[str, Any], stdio: list[int], sockets: list[socket.socket]) -> None:
    """The forked child: becomes ``python -m MODULE args`` on ``stdio`` (stdin, stdout, stderr
    fds) and never returns."""
    code = 1
    try:
        for sock in sockets:
            sock.close()
        os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if kind == "worker":
            import gevent

            gevent.reinit()
        sys.argv = [MODULE[kind], *request["args"]]
        try:
            runpy.run_module(MODULE[kind], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
    except BaseException:  # as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            # What the interpreter's own exit does: join non-daemon threads, then run atexit.
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(kind: str, listener: socket.socket, lock: Path) -> None:
    fork = _preload(kind)
    original_select = select.select
    if kind == "worker":
        from gevent import monkey

        original_select = monkey.get_original("select", "select")
    path = listener.getsockname()
    clients: list[socket.socket] = []
    owner: dict[int, socket.socket] = {}  # child pid -> the client that launched it
    reached = False
    started = time.monotonic()
    while True:
        readable, _, _ = original_select([listener, *clients], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                clients.append(listener.accept()[0])
                reached = True
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:  # that test process is gone
                clients.remove(sock)
                sock.close()
                continue
            pid = fork()
            if pid == 0:
                _child(kind, json.loads(msg), fds, [listener, *clients])
            for fd in fds:
                os.close(fd)
            owner[pid] = sock
            sock.send(json.dumps({"pid": pid}).encode())
        while owner:
            try:
                pid, status, _ = os.wait4(-1, os.WNOHANG)  # gevent patches waitpid in a worker zygote
            except ChildProcessError:
                break
            if pid == 0:
                break
            launcher = owner.pop(pid)
            if launcher in clients:
                launcher.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if not clients and (reached or time.monotonic() - started > FIRST_CLIENT_S):
            try:
                with _locked(lock):  # what a client connects under: none is on its way once we hold it
                    if original_select([listener], [], [], 0)[0]:
                        continue
                    Path(path).unlink(missing_ok=True)
                    return
            except FileNotFoundError:
                return  # the run is over: its directory went with it


# --- the test process's side --------------------------------------------------------------------


class Process(Protocol):
    """What the harness uses of a process it started: a ``subprocess.Popen`` or a ``Forked``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def _exists(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie has ended (a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


class Forked:
    """A zygote's child, with the part of ``subprocess.Popen`` the harness and tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.drain(0)
            self.returncode = self.zygote.codes.get(self.pid)
        if self.returncode is None and not self.zygote.running and not _exists(self.pid):
            # Ended after its zygote, which can no longer say how: init reaped it.
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if self.zygote.running:
                self.zygote.drain(0.2 if left is None else min(left, 0.2))
            else:
                time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote of ``kind`` for this test process, started on first use (``launch``)."""

    def __init__(self, kind: str, run_dir: Path | None = None) -> None:
        """``run_dir``: where the run's zygotes listen (``RUN_DIR_ENV``); None: one of this
        zygote's own, shared with no other test process."""
        self.kind = kind
        self.run_dir = run_dir
        self.codes: dict[int, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None  # the zygote, where this client started it
        self._own_dir: Path | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}

    def suits(self, cmd: Sequence[str], env: dict[str, str]) -> bool:
        """Whether ``cmd`` (``python -m MODULE …``) can be forked here alike (module docstring)."""
        if list(cmd[:3]) != [sys.executable, "-m", MODULE[self.kind]] or not forks_alike(env):
            return False
        return self._sock is None or import_env(env) == self._env

    def launch(self, cmd: Sequence[str], env: dict[str, str], log_fd: int, cwd: Path = REPO) -> Forked:
        """``cmd`` forked, its output and errors to ``log_fd``, its stdin empty."""
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            return self.launch_stdio(cmd, env, (devnull, log_fd, log_fd), cwd)
        finally:
            os.close(devnull)

    def launch_stdio(self, cmd: Sequence[str], env: dict[str, str], stdio: tuple[int, int, int],
                     cwd: Path = REPO) -> Forked:
        """``cmd`` forked on ``stdio`` (its stdin, stdout and stderr fds, which the child dups)."""
        if self._sock is None:
            self._start(env)
        assert self._sock is not None
        request = {"args": list(cmd[3:]), "env": env, "cwd": str(cwd)}
        socket.send_fds(self._sock, [json.dumps(request).encode()], list(stdio))
        while True:
            reply = self._recv(timeout_s=60)
            if "pid" in reply:
                return Forked(self, reply["pid"], list(cmd))

    @property
    def running(self) -> bool:
        return self._sock is not None

    def drain(self, timeout_s: float) -> None:
        """Read the zygote's exit reports for up to ``timeout_s`` (0: what has arrived)."""
        if self._sock is None:
            return
        if select.select([self._sock], [], [], timeout_s)[0]:
            while select.select([self._sock], [], [], 0)[0]:
                self._recv(timeout_s=0)

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        assert self._sock is not None
        if not select.select([self._sock], [], [], timeout_s)[0] and timeout_s:
            raise AssertionError(f"the {self.kind} zygote did not answer in {timeout_s} s")
        msg = self._sock.recv(1 << 16)
        if not msg:
            raise AssertionError(f"the {self.kind} zygote ended")
        reply: dict[str, Any] = json.loads(msg)
        if "exit" in reply:
            self.codes[reply["exit"]] = reply["code"]
        return reply

    def _socket_path(self, env: dict[str, str]) -> Path:
        """Where the run's zygote of this kind for ``env``'s import environment listens."""
        if self.run_dir is None:
            self.run_dir = self._own_dir = Path(tempfile.mkdtemp(prefix="specfleet-zygote-"))
        digest = hashlib.sha256(json.dumps(sorted(import_env(env).items())).encode()).hexdigest()[:16]
        return self.run_dir / f"{self.kind}-{digest}.sock"

    def serving(self, env: dict[str, str]) -> bool:
        """Whether a zygote for ``env`` runs already (another test process of the run started it)."""
        return self.run_dir is not None and self._socket_path(env).exists()

    def _start(self, env: dict[str, str]) -> None:
        """Connects to the run's zygote for ``env``'s import environment, started here if none runs."""
        self._env = import_env(env)
        path = self._socket_path(env)
        lock = path.with_suffix(".lock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with _locked(lock):
            try:
                sock.connect(str(path))
            except (FileNotFoundError, ConnectionRefusedError):
                path.unlink(missing_ok=True)  # one whose zygote was killed
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                listener.bind(str(path))
                listener.listen(16)
                zygote_env = {**{k: v for k, v in os.environ.items() if not k.startswith(IMPORT_ENV_PREFIXES)},
                              **self._env}
                # Its own session: a test's killpg of its fleet never reaches the run's zygote.
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "harness.zygote", self.kind, str(listener.fileno()), str(lock)],
                    pass_fds=[listener.fileno()], env=zygote_env, cwd=REPO, stdin=subprocess.DEVNULL,
                    start_new_session=True)
                listener.close()
                sock.connect(str(path))
        self._sock = sock

    def close(self) -> None:
        """Leaves the zygote, which ends once no test process uses it (its children are the tests'
        to end: each in a session of its own)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._own_dir is not None:
            # Its only client has gone: it ends now, and its directory may go once its lock has.
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=5)
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = self.run_dir = None
        # A run's zygote serves the run's other test processes on: not waited for at each one's
        # teardown (subprocess reaps a dropped Popen later, or init once this process is gone).
        self._proc = None


class Zygotes:
    """This test process's zygotes (tests/conftest.py ``zygotes``): per kind, one for each
    environment the libraries see at import (``import_env``), at most ``per_kind`` of them.

    An environment gets its zygote on its ``after[kind]``-th launch: the launch whose plain starts
    would have cost more than the zygote's imports. A producer's plain start (~1.9 CPU-s) is cheaper
    than its zygote (~3), so a test's one-off environment (a ``PYTHONPATH`` of its own, test_plan's
    hooks) starts plainly and leaves the slot to the environments most launches share; a worker's
    (~3.6) costs more than its zygote (~2.7) from the first. ``common``: environments known to be
    launched many times (the fleet's own, ``harness.fleet.base_env``) get theirs, of both kinds, on
    their first launch: each of the six test processes started its first producer plainly while
    the run's zygote for it was not up yet, ~10 CPU-s a run.
    """

    def __init__(self, per_kind: int = 3, after: Mapping[str, int] = AFTER, run_dir: Path | None = None,
                 common: Sequence[dict[str, str]] = ()) -> None:
        self.per_kind = per_kind
        self.run_dir = run_dir
        self.after = after
        self._common = {frozenset(import_env(env).items()) for env in common}
        self._zygotes: dict[tuple[str, frozenset[tuple[str, str]]], Zygote] = {}
        self._seen: collections.Counter[tuple[str, frozenset[tuple[str, str]]]] = collections.Counter()

    def suiting(self, cmd: Sequence[str], env: dict[str, str]) -> Zygote | None:
        kind = next((k for k, module in MODULE.items() if list(cmd[1:3]) == ["-m", module]), None)
        if kind is None or not forks_alike(env):
            return None  # counted towards no environment's zygote
        key = (kind, frozenset(import_env(env).items()))
        if key not in self._zygotes:
            self._seen[key] += 1
            zygote = Zygote(kind, self.run_dir)
            # One another test process of the run started costs nothing to use.
            if self._seen[key] < self.after[kind] and key[1] not in self._common and not zygote.serving(env):
                return None
            if sum(k == kind for k, _ in self._zygotes) >= self.per_kind:
                return None
            self._zygotes[key] = zygote
        zygote = self._zygotes[key]
        return zygote if zygote.suits(cmd, env) else None

    def launch(self, cmd: Sequence[str], env: dict[str, str], log_fd: int) -> Forked | None:
        """``cmd`` forked from its kind's zygote, or None where none suits it (start it plainly)."""
        zygote = self.suiting(cmd, env)
        return zygote.launch(cmd, env, log_fd) if zygote is not None else None

    def run(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(cmd, capture_output=True, text=True, …)``, forked where a zygote suits."""
        env = dict(os.environ if env is None else env)
        where = Path.cwd() if cwd is None else Path(cwd)
        zygote = self.suiting(cmd, env)
        if zygote is None:
            return _plain_run(cmd, env, where, timeout, input)
        return _communicate(zygote, list(cmd), env, where, timeout, input)

    def close(self) -> None:
        for zygote in self._zygotes.values():
            zygote.close()


#: the test session's zygotes (tests/conftest.py sets it), for ``run``; None: plain processes
shared: Zygotes | None = None


def run(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, …)`` for the tests' CLI calls: forked
    from the session's zygote where one suits (``shared``), else a plain process."""
    if shared is None:
        return _plain_run(cmd, env, cwd, timeout, input)
    return shared.run(cmd, env=env, cwd=cwd, timeout=timeout, input=input)


def _plain_run(cmd: Sequence[str], env: dict[str, str] | None, cwd: str | Path | None, timeout: float | None,
               input: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          input=input, stdin=None if input is not None else subprocess.DEVNULL)


def _communicate(zygote: Zygote, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float | None,
                 input: str | None) -> subprocess.CompletedProcess[str]:
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = zygote.launch_stdio(cmd, env, (stdin_r, out_w, err_w), cwd)
    finally:
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
    with os.fdopen(stdin_w, "wb") as stdin:
        if input:
            stdin.write(input.encode())  # a CLI reads its answer at once; no test sends more than a pipe holds
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = None if timeout is None else time.monotonic() + timeout
    open_fds = [out_r, err_r]
    try:
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout or 0, _text(chunks[out_r]), _text(chunks[err_r]))
            for fd in select.select(open_fds, [], [], left)[0]:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
    finally:
        os.close(out_r)
        os.close(err_r)
    left = None if deadline is None else max(deadline - time.monotonic(), 1)
    code = proc.wait(timeout=left)
    return subprocess.CompletedProcess(cmd, code, _text(chunks[out_r]), _text(chunks[err_r]))


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode(errors="replace")


if __name__ == "__main__":
    serve(sys.argv[1], socket.socket(fileno=int(sys.argv[2])), Path(sys.argv[3]))
