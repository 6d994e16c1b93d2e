"""The seed's design, faithfully: the one-file asyncio script specfleet replaces.

    .venv/bin/python bench/seed_design.py --base-url http://127.0.0.1:8765 --prompts data.jsonl \
        --tokenizer demo/tokenizer --out rows.jsonl --concurrency 2000 --budget-tokens 10000000

One process, ``aiohttp``, a semaphore of ``--concurrency`` requests, every prompt a task; each answer
rebuilt as reasoning + ``</think>`` + content + ``<|im_end|>`` and tokenized in the event loop; a
token budget that cancels every pending task once it is passed. No retries beyond a few for 429/5xx,
no self-checks, no exactly-once: what the seed did. Kept here only to be measured against
(``bench/versus_seed.py``); nothing in the product imports it.

Prints one JSON line of its own figures at the end (rows, tokens, first/last request times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import aiohttp
from transformers import AutoTokenizer


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.prompts, encoding="utf-8") as fh:
        prompts = [json.loads(line) for line in fh if line.strip()]
    sem = asyncio.Semaphore(args.concurrency)
    kept_tokens = 0
    rows = 0
    first_request_s: float | None = None
    startup_cpu_s = 0.0  # CPU spent before the first request (imports, tokenizer, tasks)
    last_answer_s = 0.0
    budget_hit = asyncio.Event()
    out = open(args.out, "w", encoding="utf-8")  # noqa: SIM115 - closed in finally
    headers = {"Authorization": f"Bearer {os.environ.get('OPENROUTER_API_KEY', 'sk-seed')}"}
    url = args.base_url.rstrip("/") + "/api/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)

    async def one(session: aiohttp.ClientSession, p: dict[str, Any]) -> None:
        nonlocal kept_tokens, rows, first_request_s, last_answer_s, startup_cpu_s
        async with sem:
            if budget_hit.is_set():
                return
            body = {"model": args.model, "messages": p["messages"], "max_tokens": args.max_tokens}
            for _attempt in range(4):
                if first_request_s is None:
                    first_request_s = time.monotonic()
                    startup_cpu_s = time.process_time()
                async with session.post(url, json=body, headers=headers) as resp:
                    if resp.status in (429, 500, 502, 503):
                        await asyncio.sleep(1.0)
                        continue
                    data = await resp.json()
                    break
            else:
                return
            last_answer_s = time.monotonic()
            msg = data["choices"][0]["message"]
            reasoning = msg.get("reasoning") or msg.get("reasoning_content") or ""
            content = msg.get("content") or ""
            text = reasoning + "</think>" + content + "<|im_end|>"
            prompt_ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
            completion_ids = tok.encode(text, add_special_tokens=False)
            kept_tokens += len(completion_ids)
            rows += 1
            out.write(json.dumps({"id": p.get("id"), "input_ids": list(prompt_ids) + completion_ids,
                                  "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids)}) + "\n")
            if kept_tokens >= args.budget_tokens:
                budget_hit.set()

    started = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            tasks = [asyncio.create_task(one(session, p)) for p in prompts]
            waiter = asyncio.create_task(budget_hit.wait())
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(waiter)
                if budget_hit.is_set():
                    for t in pending:  # the seed's budget stop: cancel everything still pending
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
            waiter.cancel()
    finally:
        out.close()
    return {
        "rows": rows,
        "kept_tokens": kept_tokens,
        "first_request_s": None if first_request_s is None else first_request_s - started,
        "last_answer_s": last_answer_s - started,
        "wall_s": time.monotonic() - started,
        "startup_cpu_s": startup_cpu_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="moonshotai/kimi-k2.5")
    ap.add_argument("--concurrency", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--budget-tokens", type=int, default=10**12)
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
