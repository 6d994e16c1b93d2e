"""``specfleet export``: a real run's output folder becomes a dataset ``datasets`` loads three ways
(``load_from_disk``, ``load_dataset("parquet")``, ``load_dataset(DIR)`` through the card), with the
rows unchanged and the provenance on its card; ``--push-to-hub`` uploads it through huggingface_hub
to a local stand-in of the Hub's HTTP API (the Hub itself cannot be reached from here)."""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from harness import zygote
from producer.export import export, push_to_hub
from tests.fleet import REPO, Fleet
from tests.run_output import demo_like_run

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Hub(BaseHTTPRequestHandler):
    """The four Hub endpoints ``create_repo`` + ``upload_folder`` call, files in ``regular`` mode
    (base64 inside the commit, as the Hub takes small files); every commit's files are recorded."""

    commits: list[dict[str, bytes]]
    auth: list[str]

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(404, {"error": "not in the stand-in"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.auth.append(self.headers.get("Authorization", ""))
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            spec = json.loads(body)
            return self._answer(200, {"url": f"{base}/datasets/{spec['organization']}/{spec['name']}"})
        if self.path == "/api/validate-yaml":
            return self._answer(200, {"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._answer(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                for f in files]})
        if "/commit/" in self.path:
            files = {}
            for line in body.decode().splitlines():
                op = json.loads(line)
                if op["key"] == "file":
                    files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            self.commits.append(files)
            repo = self.path.split("/api/datasets/", 1)[1].split("/commit/", 1)[0]
            return self._answer(200, {"commitUrl": f"{base}/datasets/{repo}/commit/{'a' * 40}",
                                      "commitOid": "a" * 40})
        self._answer(404, {"error": f"no {self.path} in the stand-in"})


@pytest.fixture
def hub() -> Iterator[tuple[str, type[_Hub]]]:
    handler = type("Hub", (_Hub,), {"commits": [], "auth": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_an_export_loads_with_datasets_and_its_card_lists_the_provenance(fleet: Fleet, tmp_path: Path) -> None:
    from datasets import load_dataset, load_from_disk

    out = demo_like_run(fleet)
    dest = tmp_path / "export"
    done = zygote.run([sys.executable, "-m", "producer.cli", "export", str(out), str(dest)],
                      cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = [r for shard in sorted((out / "V").glob("shard-*.jsonl")) for r in _rows(shard)]
    cut = _rows(out / "V" / "truncated.jsonl")
    assert len(kept) == 22 and len(cut) == 2

    arrow = load_from_disk(str(dest / "arrow"))
    assert set(arrow) == {"V", "V_truncated"}
    assert arrow["V"]["input_ids"] == [r["input_ids"] for r in kept]
    assert arrow["V"]["loss_mask"] == [r["loss_mask"] for r in kept]
    assert arrow["V_truncated"]["id"] == [r["id"] for r in cut]
    assert arrow["V"]["conversations"][0][-1]["content"] == kept[0]["conversations"][-1]["content"]
    with_tools = next(i for i, r in enumerate(kept) if r.get("tools"))
    assert json.loads(arrow["V"]["tools"][with_tools]) == kept[with_tools]["tools"]

    parquet = load_dataset("parquet", data_files={"V": str(dest / "data" / "V-*.parquet")})
    assert parquet["V"]["id"] == [r["id"] for r in kept]
    assert load_dataset(str(dest))["V_truncated"]["finish_reason"] == ["length", "length"]  # the card's configs

    card = (dest / "README.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    for fact in (manifest["manifest_id"], manifest["model"], manifest["tokenizer"]["source"],
                 manifest["tokenizer"]["files"]["tokenizer.json"], manifest["chat_template_sha256"],
                 "| V | 22 |", "| V_truncated | 2 |"):
        assert fact in card, fact
    served = {r["provider"] for r in kept}
    assert all(p in card for p in served), served
    if len(served) > 1:
        assert f"V was served by {len(served)} provider(s)" in card


def test_push_to_hub_uploads_the_parquet_files_and_the_card(fleet: Fleet, tmp_path: Path,
                                                             hub: tuple[str, type[_Hub]]) -> None:
    endpoint, handler = hub
    out = demo_like_run(fleet)
    result = export(out, tmp_path / "export")
    url = push_to_hub(result, "someone/drafter-rows", token="hf_standin_token", endpoint=endpoint)
    assert url.endswith("/datasets/someone/drafter-rows"), url
    assert len(handler.commits) == 1
    files = handler.commits[0]
    assert set(files) == {"README.md", "data/V-00000-of-00001.parquet", "data/V_truncated-00000-of-00001.parquet"}
    for name, content in files.items():
        assert content == (result.dest / name).read_bytes(), name
    assert handler.auth and all(a == "Bearer hf_standin_token" for a in handler.auth), handler.auth

    # The CLI against a Hub it cannot reach: exit 2, one line naming the repo, the token never shown.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_secret_x"}
    done = zygote.run([sys.executable, "-m", "producer.cli", "export", str(out), str(tmp_path / "e"),
                       "--push-to-hub", "someone/rows"], cwd=REPO, timeout=300, env=env)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "specfleet: cannot push to the hub dataset 'someone/rows'" in done.stderr, done.stderr[-2000:]
    assert "hf_secret_x" not in done.stdout + done.stderr
