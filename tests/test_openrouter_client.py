"""The client's classification of every answer shape, over real HTTP to a tiny local server."""

from __future__ import annotations

import json
import queue
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import gevent
import gevent.queue
import pytest
from urllib3 import HTTPConnectionPool

from common.errors import (
    AccountRefusedError,
    AnswerTooLargeError,
    FatalUpstreamError,
    InFlightBudgetError,
    MisconfiguredError,
    RetryableUpstreamError,
    WeightExceedsBudgetError,
)
from workers.pipeline import retry
from workers.pipeline.retry import backoff_s
from workers.upstreams.openrouter import OpenRouterClient, parse_retry_after_s
from workers.upstreams.upstream import Request

KEY = "sk-or-v1-test-key-123456"
OK = {"id": "gen-1", "provider": "P", "model": "m",
      "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "hi", "reasoning": "r"}}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001}}


class _Handler(BaseHTTPRequestHandler):
    reply: tuple[int, dict[str, str], bytes] = (200, {}, b"")
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append({"headers": dict(self.headers), "body": json.loads(body), "path": self.path})
        status, headers, payload = type(self).reply
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _client(url: str) -> OpenRouterClient:
    return OpenRouterClient(url, KEY, pool_size=4, app_url="https://x", app_title="t")


def _request(model: str = "m", **params: Any) -> Request:
    return Request(model=model, messages=[{"role": "user", "content": "q"}], tools=None, max_tokens=7,
                   params=params, timeout_s=5)


def _answer(status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    _Handler.reply = (status, headers or {}, raw)


def test_a_good_answer_and_what_was_sent(server: str) -> None:
    _answer(200, OK)
    _Handler.seen.clear()
    a = _client(server).complete(_request(temperature=0.5, reasoning={"effort": "high"}))
    assert (a.finish_reason, a.provider, a.generation_id, a.content, a.reasoning) == ("stop", "P", "gen-1", "hi", "r")
    assert a.usage == {"prompt_tokens": 3, "completion_tokens": 2, "reasoning_tokens": 0, "cost": 0.001}
    sent = _Handler.seen[0]["headers"]
    assert sent["Authorization"] == f"Bearer {KEY}" and sent["X-Title"] == "t"
    assert _Handler.seen[0]["body"] == {"model": "m", "max_tokens": 7, "temperature": 0.5,
                                        "reasoning": {"effort": "high"}, "messages": [{"role": "user", "content": "q"}]}


def test_each_call_sends_its_own_body_from_the_request_prepared_once(server: str) -> None:
    _answer(200, OK)
    _Handler.seen.clear()
    client = _client(server)
    for effort in ("a much longer effort than the first", "low"):
        client.complete(_request(reasoning={"effort": effort}))
    assert [s["body"]["reasoning"]["effort"] for s in _Handler.seen] == ["a much longer effort than the first", "low"]
    assert [int(s["headers"]["Content-Length"]) for s in _Handler.seen] == [
        len(json.dumps(s["body"], separators=(",", ":")).encode()) for s in _Handler.seen]
    assert all(s["headers"]["Authorization"] == f"Bearer {KEY}" for s in _Handler.seen)


def test_proxy_variables_are_honoured(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads HTTP(S)_PROXY / NO_PROXY once, when it is built (not on every call)."""
    _answer(200, OK)
    _Handler.seen.clear()
    monkeypatch.setenv("HTTP_PROXY", server)  # the test server plays the proxy
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert _client("http://upstream.invalid").complete(_request()).content == "hi"
    assert _Handler.seen[-1]["path"] == "http://upstream.invalid/api/v1/chat/completions"  # proxy form

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: only a bypass can answer
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert _client(server).complete(_request()).content == "hi"
    assert _Handler.seen[-1]["path"] == "/api/v1/chat/completions"
    monkeypatch.delenv("NO_PROXY")
    with pytest.raises(RetryableUpstreamError):
        _client(server).complete(_request())


@pytest.mark.parametrize("suffix", ["", "/", "/api/v1", "/api/v1/", "/api/v1/chat/completions"])
def test_every_spelling_of_the_base_url_reaches_the_chat_endpoint(server: str, suffix: str) -> None:
    assert _client(server + suffix).url == server + "/api/v1/chat/completions"
    _answer(200, OK)
    _Handler.seen.clear()
    assert _client(server + suffix).complete(_request()).content == "hi"
    assert len(_Handler.seen) == 1


@pytest.mark.parametrize(
    ("status", "body", "headers", "kind", "reason"),
    [
        (429, {"error": {"code": 429, "message": "slow"}}, {"Retry-After": "7"}, RetryableUpstreamError, "http_429"),
        (502, {"error": {"code": 502, "message": "down"}}, {}, RetryableUpstreamError, "http_502"),
        (503, {"error": {"code": 503, "message": "no provider"}}, {}, RetryableUpstreamError, "http_503"),
        (408, {"error": {"code": 408, "message": "timeout"}}, {}, RetryableUpstreamError, "http_408"),
        # 402s read by error.metadata.reason / limit_source, not the status (openrouter.md): the
        # in-flight budget (also the older form: no reason, a Retry-After), one request over the
        # whole balance, and out of money or over the key's limit.
        (402, {"error": {"code": 402, "message": "budget"}}, {"Retry-After": "1"}, InFlightBudgetError,
         "in_flight_budget_exhausted"),
        (402, {"error": {"code": 402, "message": "would exceed your available credits given your current in-flight",
                         "metadata": {"reason": "in_flight_budget_exhausted",
                                      "limit_source": "openrouter_in_flight_budget"}}},
         {"Retry-After": "3"}, InFlightBudgetError, "in_flight_budget_exhausted"),
        (402, {"error": {"code": 402, "message": "estimate over the balance",
                         "metadata": {"reason": "weight_exceeds_budget", "limit_source": "openrouter_credits"}}},
         {}, WeightExceedsBudgetError, "weight_exceeds_budget"),
        (402, {"error": {"code": 402, "message": "no credits"}}, {}, AccountRefusedError, "http_402"),
        (402, {"error": {"code": 402, "message": "key limit", "metadata": {"limit_source": "openrouter_key_limit"}}},
         {"Retry-After": "5"}, AccountRefusedError, "http_402"),
        (400, {"error": {"code": 400, "message": "bad"}}, {}, FatalUpstreamError, "http_400"),
        (401, {"error": {"code": 401, "message": "key"}}, {}, AccountRefusedError, "http_401"),
        (404, {"error": {"code": 404, "message": "No endpoints found for m."}}, {}, MisconfiguredError, "http_404"),
        (404, b"<html>Not Found</html>", {}, MisconfiguredError, "http_404"),
        (400, {"error": {"code": 400, "message": "m is not a valid model ID"}}, {}, MisconfiguredError, "http_400"),
        (403, {"error": {"code": 403, "message": "moderated"}}, {}, FatalUpstreamError, "http_403"),
        (200, b'{"id": "gen-1", "choices": [{"mess', {}, RetryableUpstreamError, "bad_json"),
        (200, {**OK, "choices": [{"finish_reason": "stop", "message": {"content": None}}],
               "error": {"code": 429, "message": "Provider returned error", "metadata": {"raw": "error code: 1015"}}},
         {}, RetryableUpstreamError, "error200_429"),
        (200, {**OK, "choices": []}, {}, RetryableUpstreamError, "no_choices"),
        (200, {**OK, "choices": [{"finish_reason": "error", "message": {"content": "x"}}]}, {},
         RetryableUpstreamError, "finish_error"),
        (200, {**OK, "choices": [{"finish_reason": "content_filter", "message": {"content": ""}}]}, {},
         FatalUpstreamError, "content_filter"),
    ],
)
def test_failures_are_classified(server: str, status: int, body: Any, headers: dict[str, str],
                                 kind: type, reason: str) -> None:
    _answer(status, body, headers)
    with pytest.raises(kind) as err:
        _client(server).complete(_request())
    assert type(err.value) is kind and err.value.reason == reason
    assert KEY not in str(err.value)
    assert str(err.value).count(reason) == 1 and reason not in err.value.detail  # the reason said once
    if kind is MisconfiguredError:  # the halt line names what to fix: the URL and the model
        assert err.value.target == f"{server}/api/v1/chat/completions with model 'm'"
    if "Retry-After" in headers and kind is not AccountRefusedError:
        assert err.value.retry_after_s == float(headers["Retry-After"])
    if kind is WeightExceedsBudgetError:  # what to lower, and to what it is now
        assert "max_tokens 7" in err.value.detail


def test_connection_refused_is_retryable() -> None:
    with pytest.raises(RetryableUpstreamError) as err:
        _client("http://127.0.0.1:9").complete(_request())
    assert err.value.reason == "connection"


def test_a_body_cut_mid_way_is_retryable() -> None:
    """The body is read in chunks: a connection broken before its end is a retryable transport
    failure, as when the whole body was read in one go (never an internal error failing the prompt)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"id\": ")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(RetryableUpstreamError) as err:
            _client(f"http://127.0.0.1:{srv.getsockname()[1]}").complete(_request())
        assert err.value.reason == "transport"
    finally:
        srv.close()


def test_an_answer_over_max_answer_bytes_fails_with_what_it_was_billed(server: str) -> None:
    big = {**OK, "choices": [{"finish_reason": "stop", "message": {"content": "x" * 300_000}}]}
    _answer(200, big)
    request = replace(_request(), max_answer_bytes=100_000)
    with pytest.raises(AnswerTooLargeError) as err:
        _client(server).complete(request)
    assert err.value.reason == "answer_too_large" and "SPECFLEET_MAX_ANSWER_BYTES = 100,000" in err.value.detail
    assert err.value.usage is not None and err.value.usage["cost"] == 0.001  # read from the body's tail
    assert retry.RetryPolicy().decide(err.value, 1).reason == "answer_too_large"  # failed at once, not retried
    client = _client(server)
    assert client.complete(replace(request, max_answer_bytes=400_000)).content == "x" * 300_000
    _answer(200, OK)
    assert client.complete(request).content == "hi"  # the pooled connection is clean after it


def test_backoff_is_jittered_exponential_and_honours_retry_after() -> None:
    rng = random.Random(1)
    err = RetryableUpstreamError("http_429", "x")
    delays = [backoff_s(a, err, base_s=1, max_s=60, rng=rng) for a in range(1, 9)]
    for attempt, d in enumerate(delays, start=1):
        ceiling = min(60, 2 ** (attempt - 1))
        assert ceiling / 2 <= d <= ceiling
    slow = RetryableUpstreamError("http_429", "x", retry_after_s=30)
    assert backoff_s(1, slow, base_s=1, max_s=60, rng=rng) >= 30
    assert parse_retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after_s("garbage") is None


class _KeepAliveHandler(_Handler):
    protocol_version = "HTTP/1.1"  # connections stay open between requests, as OpenRouter's do
    connections = 0

    def setup(self) -> None:
        type(self).connections += 1
        super().setup()


def _settled(client: OpenRouterClient, expected_connections: int) -> None:
    deadline = time.monotonic() + 5
    while (client._warming or _KeepAliveHandler.connections < expected_connections) and time.monotonic() < deadline:
        gevent.sleep(0.01)
    gevent.sleep(0.05)  # and nothing more arrives


@pytest.mark.parametrize("queue_cls", [queue.LifoQueue, gevent.queue.LifoQueue], ids=["stdlib", "gevent"])
def test_warm_opens_the_connections_of_held_requests_and_the_requests_use_them(
    queue_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # urllib3's pool takes the queue class of the process: gevent's in a monkey-patched worker.
    monkeypatch.setattr(HTTPConnectionPool, "QueueCls", queue_cls)
    _KeepAliveHandler.connections = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = _client(f"http://127.0.0.1:{httpd.server_address[1]}")  # a pool of 4
        client.warm(3)
        _settled(client, 3)
        assert _KeepAliveHandler.connections == 3
        client.warm(3)  # three are open and idle already
        client.warm(10)  # never more than the pool keeps
        _settled(client, 4)
        assert _KeepAliveHandler.connections == 4
        _answer(200, OK)
        for _ in range(3):
            assert client.complete(_request()).content == "hi"
        assert _KeepAliveHandler.connections == 4  # the requests went out on the warmed connections
    finally:
        httpd.shutdown()
        httpd.server_close()
