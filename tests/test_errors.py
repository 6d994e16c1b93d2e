"""The error tree's exit codes: one table (``exit_code`` on common/errors.py's classes) that the
tree's docstring states, that the CLI, the run and the worker exit by, and whose codes mean one
thing each."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from common import errors
from producer import execute

#: "Name   meaning: exit N" lines of the tree drawn in common/errors.py's docstring.
_TREE_LINE = re.compile(r"^[\s│├└─]*(\w+)\s{2,}.*?\bexit (\d+)\s*$")


def _stated() -> dict[str, int]:
    return {m[1]: int(m[2]) for line in (errors.__doc__ or "").splitlines() if (m := _TREE_LINE.match(line))}


def test_the_docstring_states_each_class_code() -> None:
    stated = _stated()
    assert stated, "no 'exit N' in common/errors.py's tree"
    for name, code in stated.items():
        assert getattr(errors, name).exit_code == code, f"the tree says {name} exits {code}"
    for cls in errors.exit_classes():
        assert stated.get(cls.__name__) == cls.exit_code, f"the tree does not state {cls.__name__}'s exit code"


def test_every_code_means_one_thing() -> None:
    codes = [cls.exit_code for cls in errors.exit_classes()]
    assert len(codes) == len(set(codes)), [(c.__name__, c.exit_code) for c in errors.exit_classes()]
    assert execute.EXIT_STOPPED_REDIS_AWAY not in codes
    assert not {0, 1} & set(codes), "0 is done, 1 is 'problems found'"
    assert errors.RedisOutage in errors.exit_classes()


def test_the_cli_exits_by_the_class() -> None:
    """A real ``specfleet status`` against a port nobody listens on: Redis stays unreachable past the
    window, the CLI says so in one line and exits ``RedisOutage.exit_code``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the CLI connects
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "status"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == errors.RedisOutage.exit_code, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "specfleet: cannot reach Redis" in proc.stderr
