"""`specfleet demo`, the README's one command for the main job: embedded Valkey, the simulator, two
workers and a run of both demo datasets, end to end, as a user on a fresh machine runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet import REPO, read_rows


@pytest.mark.timeout(300)
@pytest.mark.long
def test_the_demo_runs_both_datasets_and_sees_its_workers_from_the_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENROUTER_", "SPECFLEET_", "REDIS_URL"))}
    out_dir = tmp_path / "demo-out"
    done = subprocess.run([sys.executable, "-m", "producer.cli", "demo", "--out", str(out_dir)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-5000:]
    assert re.search(r"^B1_glaive: budget reached, [\d,]+ of 400,000 tokens", done.stdout, re.M), text[-3000:]
    assert re.search(r"^B4_mixturethoughts: all prompts done", done.stdout, re.M), text[-3000:]
    assert read_rows(out_dir, "B1_glaive") and read_rows(out_dir, "B4_mixturethoughts")
    # The start-up ping finds the demo's two workers while the run goes on, not after it (it once
    # waited on a connection the run's enqueue shared until the end, and warned of no workers).
    assert "no worker answered a ping" not in text, text[-3000:]
    log = done.stderr
    online = log.find("2 worker(s) online")
    assert 0 <= online < log.find("B1_glaive: budget reached"), log[-3000:]
