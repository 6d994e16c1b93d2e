"""A demo-like fleet run whose output folder the validate and export tests read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fleet import Fleet, prompts, write_jsonl


def _sim(spec: dict[str, Any], tag: str) -> dict[str, Any]:
    return {"id": tag, "messages": [{"role": "user", "content": f"#sim {json.dumps(spec)} {tag}"}]}


def demo_like_run(fleet: Fleet, dataset: str = "V") -> Path:
    """24 prompts over three shards of ``dataset``, one with tools, two cut by max_tokens (set apart
    in truncated.jsonl by ``truncated = "separate"``, the product default); the output folder."""
    tool = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    rows: list[dict[str, Any] | str] = [*prompts(20)]
    rows += [{"id": "tool0", "messages": [{"role": "user", "content": "Look up item 0."}], "tools": tool}]
    rows += [_sim({"content": "A plain answer.", "reasoning": "Short.", "finish_reason": "stop"}, "plain")]
    rows += [_sim({"reasoning": "Thinking on and on", "content": None, "finish_reason": "length"}, f"cut{i}")
             for i in range(2)]
    data = write_jsonl(fleet.tmp / "rows.jsonl", rows)
    config = fleet.write_config([{"name": dataset, "path": data, "length": "short"}], truncated="separate")
    config.write_text(config.read_text().replace("shard_rows = 100", "shard_rows = 8"))
    fleet.start_simulator("--latency-median-ms", "10")
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config)
    assert (fleet.out / "manifest.json").is_file(), "the run wrote no manifest.json"
    return fleet.out
