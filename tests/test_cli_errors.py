"""Every config or environment mistake is one ``specfleet:`` line and a non-zero exit, never a
traceback: what the user sees is what to fix, not where in the code it was noticed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import zygote

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "demo" / "fleet.toml"
NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield int(s.getsockname()[1])


def specfleet(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "OPENROUTER_", "SPECFLEET_"))}
    return zygote.run([sys.executable, "-m", "producer.cli", *args], env={**base, **env}, cwd=REPO,
                      timeout=60)


def assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("specfleet: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (("exporter",), {"REDIS_URL": NO_REDIS, "SPECFLEET_METRICS_PORT": "abc"}, ("SPECFLEET_METRICS_PORT",)),
        (("run", str(DEMO_CONFIG)), {"REDIS_URL": NO_REDIS, "SPECFLEET_METRICS_PORT": "99999"},
         ("SPECFLEET_METRICS_PORT", "65535")),
        (("worker",), {"REDIS_URL": NO_REDIS, "SPECFLEET_CONCURRENCY": "0"}, ("SPECFLEET_CONCURRENCY",)),
        (("worker",), {}, ("REDIS_URL",)),
        (("status",), {"REDIS_URL": "http://localhost:6379"}, ("REDIS_URL",)),
        (("status",), {"REDIS_URL": NO_REDIS}, ("cannot reach Redis",)),
        (("check", str(DEMO_CONFIG)), {"SPECFLEET_LOG_LEVEL": "loud"}, ("SPECFLEET_LOG_LEVEL",)),
        (("check", str(DEMO_CONFIG)), {"SPECFLEET_QUEUE_POLL_S": "soon"}, ("SPECFLEET_QUEUE_POLL_S",)),
        (("run", "/nonexistent/fleet.toml"), {"REDIS_URL": NO_REDIS}, ("/nonexistent/fleet.toml",)),
    ],
    ids=["exporter-port-word", "run-port-range", "worker-concurrency", "worker-no-redis", "status-url-scheme",
         "status-redis-down", "check-log-level", "check-poll", "run-no-config"],
)
def test_bad_env_or_config_is_one_specfleet_line(args: tuple[str, ...], env: dict[str, str],
                                                 needles: tuple[str, ...]) -> None:
    assert_one_line(specfleet(*args, **env), *needles)


def test_a_taken_metrics_port_is_one_line(busy_port: int, tmp_path: Path) -> None:
    assert_one_line(specfleet("exporter", "--port", str(busy_port), REDIS_URL=NO_REDIS), f"port {busy_port}")
    assert_one_line(specfleet("run", str(DEMO_CONFIG), "--out", str(tmp_path), "--metrics-port", str(busy_port),
                              REDIS_URL=NO_REDIS), f"port {busy_port}")


def test_an_invalid_run_file_starts_with_specfleet_and_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nname = 1\n")
    proc = specfleet("check", str(bad))
    assert_one_line(proc, str(bad), "not valid TOML")
