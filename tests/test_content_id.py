"""A row without an id gets a content-hash id that every process computes alike.

The id is the prompt's key in the done set: the producer that resumes a run, or a second host's
producer, is another process, and Python salts ``hash()`` per process (``PYTHONHASHSEED``). An id
that depended on it would make a resume ask every id-less row again (and pay for it twice).
Real subprocesses, each with its own hash seed, read the same file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fleet import REPO, write_jsonl

_READ_IDS = """
import json, sys
from pathlib import Path
from common.datasets import ReadStats, read_prompts
print(json.dumps([p.id for p in read_prompts(Path(sys.argv[1]), [], ReadStats())]))
"""


def _ids_in_a_process(path: Path, hash_seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _READ_IDS, str(path)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    ids: list[str] = json.loads(out.stdout)
    return ids


def test_a_row_without_an_id_gets_the_same_id_in_every_process(tmp_path: Path) -> None:
    rows: list[dict[str, object] | str] = [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"messages": [{"content": "Hallo, wie geht's? ünïcödé", "role": "user"}]},
        {"conversations": [{"from": "human", "value": "Summarise the plot of Hamlet."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
         "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]},
        {"id": "named", "messages": [{"role": "user", "content": "I have my own id."}]},
    ]
    path = write_jsonl(tmp_path / "no_ids.jsonl", rows)
    first = _ids_in_a_process(path, "1")
    second = _ids_in_a_process(path, "2")
    assert len(first) == len(rows) and first[-1] == "named"
    assert all(i.startswith("h-") for i in first[:-1]) and len(set(first)) == len(rows)
    assert second == first, "a content-hash id differs between processes: a resume would ask those rows again"
