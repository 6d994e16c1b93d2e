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


# --- the first mistakes (issue 39): each answered in one line, before anything is sent ---------------


def test_an_output_folder_under_a_file_is_one_line_before_any_network_call(tmp_path: Path) -> None:
    # The models endpoint is a socket that listens and never answers: a plan that reached for it
    # would leave a connection waiting in its backlog.
    with socket.socket() as upstream:
        upstream.bind(("127.0.0.1", 0))
        upstream.listen()
        upstream.settimeout(0)
        base = f"http://127.0.0.1:{upstream.getsockname()[1]}"
        (tmp_path / "a-file").write_text("not a folder")
        for redis_env in ({}, {"REDIS_URL": NO_REDIS}):  # a private Valkey, or a Redis given
            proc = specfleet("run", str(DEMO_CONFIG), "--out", str(tmp_path / "a-file" / "out"),
                             OPENROUTER_BASE_URL=base, **redis_env)
            assert proc.returncode == 2, proc.stderr
            assert_one_line(proc, f"{tmp_path / 'a-file'}, which is a file")
        with pytest.raises(BlockingIOError):
            upstream.accept()  # nobody called
    assert not (tmp_path / "a-file.valkey").exists()


def test_help_needs_no_environment() -> None:
    for args in (("worker", "--help"), ("run", "--help"), ("--help",)):
        proc = specfleet(*args)  # no REDIS_URL, no key
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: specfleet"), proc.stdout
        assert "REDIS_URL is not set" not in proc.stdout + proc.stderr


def _run_file(folder: Path, data: str, name: str = "a.jsonl") -> Path:
    (folder / name).write_text(data)
    config = folder / "fleet.toml"
    config.write_text(f'[model]\nname = "m"\ntokenizer = "{REPO / "demo" / "tokenizer"}"\n'
                      f'[[datasets]]\nname = "A"\npath = "{name}"\n')
    return config


def test_check_exits_non_zero_when_it_found_problems(tmp_path: Path) -> None:
    good = '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
    assert specfleet("check", str(_run_file(tmp_path, good))).returncode == 0
    for bad in ("", good + "{not json\n", good + good):  # no prompt, a malformed row, a duplicate id
        proc = specfleet("check", str(_run_file(tmp_path, bad)))
        assert proc.returncode == 1, (bad, proc.stdout)


def test_a_json_array_gets_a_use_jsonl_hint(tmp_path: Path) -> None:
    config = _run_file(tmp_path, '[{"id": "a", "messages": [{"role": "user", "content": "hi"}]}]\n', "a.json")
    proc = specfleet("check", str(config))
    assert proc.returncode == 1
    assert "a JSON array, not JSONL" in proc.stdout and "jq -c '.[]' a.json > a.jsonl" in proc.stdout


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert_one_line(specfleet("demo", "--out", str(mine)), "not made by specfleet demo")
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_the_cli_reads_dot_env_in_its_folder_and_the_environment_wins(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("# as compose reads it\nexport SPECFLEET_LOG_LEVEL='loud'\n")
    good = '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
    config = _run_file(tmp_path, good)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "OPENROUTER_", "SPECFLEET_"))}

    def check(**env: str) -> subprocess.CompletedProcess[str]:
        return zygote.run([sys.executable, "-m", "producer.cli", "check", str(config)], env={**base, **env},
                          cwd=tmp_path, timeout=60)

    assert_one_line(check(), "SPECFLEET_LOG_LEVEL='LOUD'")  # read from .env
    assert check(SPECFLEET_LOG_LEVEL="INFO").returncode == 0  # already set: it wins
    (tmp_path / ".env").write_text("SPECFLEET_LOG_LEVEL INFO\n")
    assert_one_line(check(), ".env:1: not KEY=value")
