"""Who asked which prompt when: one record per chat request, for chaos runs (bench/soak.py).

A WSGI middleware around the app, so the chat flow itself stays untouched: it reads the prompt
hash from the request body, the asking client from ``X-Title`` (OpenRouter's app attribution
header; a soak gives every worker process its own), and status and generation id from the reply.
``GET /_sim/requests`` returns the records (``POST /_sim/reset`` empties them); the ledger's
``/_sim/stats?detail=1`` says, per generation id, which fault it met and whether its client was
gone when it was ready.
"""

from __future__ import annotations

import io
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from simulator.seeding import prompt_hash

CHAT_PATH = "/api/v1/chat/completions"
REQUESTS_PATH = "/_sim/requests"
RESET_PATH = "/_sim/reset"
MAX_RECORDS = 1_000_000
#: The request body's keys a record keeps (sampling and provider routing), not the messages.
LOGGED_PARAMS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "provider", "max_tokens")

StartResponse = Callable[..., Any]


class RequestLog:
    def __init__(self, app: Callable[[dict[str, Any], StartResponse], Iterable[bytes]]) -> None:
        self.app = app
        self.records: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == REQUESTS_PATH and environ["REQUEST_METHOD"] == "GET":
            body = json.dumps({"requests": list(self.records)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == RESET_PATH and environ["REQUEST_METHOD"] == "POST":
            self.records.clear()  # a reset simulator is as if just started: no request seen yet
        if path != CHAT_PATH or environ["REQUEST_METHOD"] != "POST":
            return self.app(environ, start_response)
        raw = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(raw)
        try:
            sent: Any = json.loads(raw)
            prompt = prompt_hash(sent["messages"])
        except (ValueError, KeyError, TypeError):
            sent, prompt = {}, ""
        record: dict[str, Any] = {"prompt": prompt, "app": environ.get("HTTP_X_TITLE", ""),
                                  "start_s": time.time(), "end_s": None, "status": None, "gen_id": None,
                                  # What a test checks the client sent: its sampling and routing.
                                  "params": {k: sent[k] for k in LOGGED_PARAMS if isinstance(sent, dict) and k in sent}}

        def recording_start_response(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            record["status"] = int(status.split(" ", 1)[0])
            record["gen_id"] = next((v for k, v in headers if k.lower() == "x-generation-id"), None)
            return start_response(status, headers, *rest)

        return _Closing(self.app(environ, recording_start_response), record, self.records)


class _Closing:
    """Ends the record when the server closes the body (after the last byte, or a dropped client)."""

    def __init__(self, inner: Iterable[bytes], record: dict[str, Any], sink: deque[dict[str, Any]]) -> None:
        self._inner, self._record, self._sink = inner, record, sink

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._inner)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self._record["end_s"] = time.time()
            self._sink.append(self._record)
