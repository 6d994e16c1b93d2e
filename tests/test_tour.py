"""``make tour``: the tutorial (docs/tutorial.md) walked as a new user walks it.

Every command of its ``console`` blocks (the lines after ``$ ``) runs verbatim, in order, in one
bash with ``set -euo pipefail``, from the clone, with a HOME of its own and none of specfleet's
variables set: its Valkey, the simulator, a worker, the plan, the run and the rows a trainer loads.
A command that stops working fails here, named.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TUTORIAL = REPO / "docs" / "tutorial.md"
#: The ports the tutorial names for its Valkey and its simulator.
PORTS = (6390, 8766)

pytestmark = [pytest.mark.fleet, pytest.mark.long, pytest.mark.timeout(900)]


def tutorial_commands(text: str) -> list[str]:
    blocks = re.findall(r"^```console\n(.*?)^```", text, re.S | re.M)
    return [line[2:] for block in blocks for line in block.splitlines() if line.startswith("$ ")]


def script(commands: list[str]) -> str:
    # Each command is said before it runs (on stderr), so a failure names it; whatever the
    # tutorial left running in the background is stopped however the script ends.
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for cmd in commands:
        lines += [f"echo {shlex.quote('$ ' + cmd)} >&2", cmd]
    return "\n".join(lines) + "\n"


def test_the_tutorial_has_the_steps_of_a_real_run() -> None:
    commands = tutorial_commands(TUTORIAL.read_text())
    for step in ("specfleet plan fleet.toml", "specfleet worker", "specfleet run fleet.toml", "demo/fleet.toml",
                 "OPENROUTER_API_KEY=", "REDIS_URL=", "load_dataset"):
        assert any(step in c for c in commands), f"the tutorial has no command with {step!r}: {commands}"


def test_the_tutorial_runs_verbatim(tmp_path: Path) -> None:
    for port in PORTS:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} (the tutorial's) is taken: free it first"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "OPENROUTER_", "SPECFLEET_"))}
    env["HOME"] = str(tmp_path)
    proc = subprocess.run(["bash", "-c", script(tutorial_commands(TUTORIAL.read_text()))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=840)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("$ ")]
    assert proc.returncode == 0, f"failed at: {said[-1] if said else '?'}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "B1_glaive: budget reached" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"num_rows: [1-9]", proc.stdout), proc.stdout[-2000:]
    assert (tmp_path / "first-run" / "out" / "report.md").is_file()
