"""A TCP proxy that adds a fixed delay each way: another host's distance to Redis, where the kernel has no netem.

    .venv/bin/python -m bench.delay_proxy --listen 10.77.0.1:6400 --to 127.0.0.1:6379 --delay-ms 1

Every chunk read on one side is written to the other ``delay_ms`` after it arrived, in order, so a
request/reply round trip gains ``2 × delay_ms`` and a pipelined burst is delayed, not serialised
(a chunk waits for its own deadline, not for the chunks before it to be answered). At 0 ms it only
copies, which is what bench/cross_host_run.py runs to show the proxy itself is not the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

CHUNK_BYTES = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    if delay_s <= 0:
        try:
            while data := await reader.read(CHUNK_BYTES):
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()
        return
    # Reading and writing in two tasks: a chunk read during another's delay is not held back by it.
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                chunks.put_nowait((time.monotonic() + delay_s, data))
        finally:
            chunks.put_nowait((0.0, b""))

    async def write() -> None:
        try:
            while True:
                due, data = await chunks.get()
                if not data:
                    return
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    await asyncio.gather(read(), write(), return_exceptions=True)


async def serve(listen_host: str, listen_port: int, to_host: str, to_port: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(to_host, to_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w, delay_s), _pipe(server_r, client_w, delay_s),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, listen_host, listen_port, limit=CHUNK_BYTES)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True, type=_addr, help="host:port")
    ap.add_argument("--to", required=True, type=_addr, help="host:port of the server")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="added each way")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        (listen_host, listen_port), (to_host, to_port) = args.listen, args.to
        asyncio.run(serve(listen_host, listen_port, to_host, to_port, args.delay_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
