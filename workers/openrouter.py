"""OpenRouter as an ``Upstream``: one chat-completions attempt per call, every failure classified.

``complete`` turns a ``Request`` into the JSON body, posts it and parses the reply into an
``Answer`` (the reasoning/content/tool-call parts of ``choices[0].message``, billed usage,
provider, generation id) or raises the error class that says what to do:
``RetryableUpstreamError`` (408, 429, 5xx, 402 with ``Retry-After``, timeouts, bad JSON,
200-with-error), ``AccountRefusedError`` (401, 402 without ``Retry-After``),
``MisconfiguredError`` (404, or a 400 saying the model does not exist or has no endpoints) and
``FatalUpstreamError`` (anything else a retry cannot fix). Retrying is the caller's job
(``workers/retry.py`` decides on the class; ``workers/generate.py`` renews the lease between
attempts, so a stopped dataset makes no further upstream calls).
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import os
import re
import time
from typing import Any

import gevent
import orjson
import requests
from requests.adapters import HTTPAdapter

from common.contract import Usage
from common.errors import (
    AccountRefusedError,
    FatalUpstreamError,
    MisconfiguredError,
    RetryableUpstreamError,
    UpstreamError,
)
from workers.upstream import Answer, Request

API_PATH = "/api/v1"
CHAT_PATH = API_PATH + "/chat/completions"
# Statuses a later attempt can fix (openrouter.md "Errors"); 402 only with Retry-After.
_RETRYABLE_STATUSES = {408, 429, 500, 502, 503, 504, 520, 522, 524, 529}
#: How OpenRouter (and OpenAI-style servers) say the model id is wrong: the run file's fault.
_NO_SUCH_MODEL = re.compile(r"no endpoints found|not a valid model|model .*not (be )?found|model_not_found|"
                            r"does not exist|unknown model", re.IGNORECASE)


def chat_url(base_url: str) -> str:
    """The chat endpoint from any spelling of the base URL people copy: ``https://openrouter.ai``,
    ``https://openrouter.ai/api/v1`` (OpenRouter's docs, the OpenAI SDK), with or without a
    trailing slash, or the full ``…/chat/completions``."""
    base = base_url.rstrip("/")
    if base.endswith(CHAT_PATH) or base.endswith("/chat/completions"):
        return base
    if base.endswith(API_PATH):
        return base + "/chat/completions"
    return base + CHAT_PATH


def parse_retry_after_s(value: str | None) -> float | None:
    """``Retry-After`` is either delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_of(body: Any) -> tuple[Any, str]:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return err.get("code"), str(err.get("message", ""))[:300]
    return None, str(err)[:300] if err else ""


def _usage(raw: Any) -> Usage:
    raw = raw if isinstance(raw, dict) else {}
    details = raw.get("completion_tokens_details") or {}
    return {
        "prompt_tokens": int(raw.get("prompt_tokens") or 0),
        "completion_tokens": int(raw.get("completion_tokens") or 0),
        "reasoning_tokens": int(details.get("reasoning_tokens") or 0),
        "cost": float(raw.get("cost") or 0.0),
    }


def _has_reasoning(message: dict[str, Any]) -> bool:
    return bool(message.get("reasoning") or message.get("reasoning_content") or message.get("reasoning_details"))


def _first_text(*values: Any) -> str | None:
    """First non-empty string; ``""`` if the only strings are empty; ``None`` if none is a string."""
    strings = [v for v in values if isinstance(v, str)]
    return next((s for s in strings if s), "" if strings else None)


def _details_text(details: Any) -> str | None:
    if not isinstance(details, list):
        return None
    items = [d for d in details if isinstance(d, dict)]
    texts = [d["text"] for d in items if d.get("type") == "reasoning.text" and isinstance(d.get("text"), str)]
    if not texts:
        texts = [
            d["summary"] for d in items if d.get("type") == "reasoning.summary" and isinstance(d.get("summary"), str)
        ]
    return "".join(texts) if texts else None


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def answer_from_message(message: dict[str, Any], finish_reason: str, **meta: Any) -> Answer:
    """Read an OpenRouter ``choices[0].message``: reasoning from ``reasoning``, else
    ``reasoning_content``, else the text of ``reasoning_details`` (summaries if it has no text).
    ``meta``: the other ``Answer`` fields (usage, provider, model, generation_id …)."""
    reasoning = _first_text(
        message.get("reasoning"), message.get("reasoning_content"), _details_text(message.get("reasoning_details"))
    )
    calls = message.get("tool_calls")
    return Answer(
        reasoning=reasoning,
        content=_content_text(message.get("content")),
        tool_calls=[dict(c) for c in calls] if isinstance(calls, list) and calls else None,
        finish_reason=finish_reason,
        **meta,
    )


def request_body(request: Request) -> dict[str, Any]:
    body: dict[str, Any] = {**request.params, "model": request.model, "max_tokens": request.max_tokens}
    body["messages"] = request.messages
    if request.tools:
        body["tools"] = request.tools
    return body


def _dumps(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # an integer past 64 bits in a tool schema: the standard encoder takes it
        return json.dumps(body).encode()


def _locked(slots: Any) -> Any:
    """The standard library's queue guards its list with a mutex; gevent's (the queue urllib3 gets
    in a monkey-patched worker) has none and needs none: greenlets switch only where they wait."""
    mutex = getattr(slots, "mutex", None)
    return mutex if mutex is not None else contextlib.nullcontext()


class OpenRouterClient:
    """One per worker process: a pooled ``requests.Session`` sized to the greenlet count."""

    def __init__(
        self, base_url: str, api_key: str, *, pool_size: int, app_url: str, app_title: str
    ) -> None:
        self.url = chat_url(base_url)
        self.where = self.url
        self._session = requests.Session()
        # Without this, requests keeps 10 sockets per host and throws the rest away after each
        # call: at 1,000 greenlets that is a TLS handshake per request.
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
        self._session.mount("https://", adapter)
        self._session.mount("http://", adapter)
        self._adapter = adapter
        self._pool_size = pool_size
        self._warming = 0
        self._prepared: requests.PreparedRequest | None = None
        # requests reads the proxy variables (and scans os.environ for no_proxy) and the CA bundle
        # variables on every call: ~9% of a busy worker. Read them once here, for this URL.
        self._session.proxies.update(requests.utils.get_environ_proxies(self.url))
        self._verify: bool | str = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        self._session.verify = self._verify
        self._session.trust_env = False
        self._session.headers.update(
            {
                "Authorization": f"Bearer {api_key}",
                "HTTP-Referer": app_url,
                "X-Title": app_title,
                "X-OpenRouter-Title": app_title,
                "Content-Type": "application/json",
            }
        )

    def complete(self, request: Request) -> Answer:
        timeout_s = request.timeout_s
        try:
            resp = self._post(_dumps(self._body(request)), timeout=(10.0, timeout_s))
        except requests.Timeout:
            raise RetryableUpstreamError("timeout", f"no answer within {timeout_s:g} s") from None
        except requests.ConnectionError as exc:
            raise RetryableUpstreamError("connection", type(exc).__name__) from None
        except requests.RequestException as exc:
            raise RetryableUpstreamError("transport", type(exc).__name__) from None
        return self._parse(resp, request.model)

    def _post(self, body: bytes, *, timeout: tuple[float, float]) -> requests.Response:
        """One POST through the session's adapter, from a request the session prepared once.

        ``Session.post`` would merge the session's settings, cookies and hooks again on every call
        (9% of a busy worker) for a URL and headers that never change, and would follow redirects,
        which an API answers with only when its URL is wrong (here: a non-200, said as such)."""
        prepared = self._template().copy()
        prepared.body = body
        prepared.headers["Content-Length"] = str(len(body))
        resp = self._adapter.send(prepared, stream=False, timeout=timeout, verify=self._verify,
                                  proxies=self._session.proxies)
        _ = resp.content  # read it all now, as Session.send does: the connection goes back to the pool
        return resp

    def _template(self) -> requests.PreparedRequest:
        if self._prepared is None:  # first use: a subclass may have changed the headers meanwhile
            self._prepared = self._session.prepare_request(requests.Request("POST", self.url, data=b""))
        return self._prepared

    def warm(self, connections: int) -> None:
        """Open connections ahead of the requests that will use them, up to ``connections`` idle
        ones (and the pool's size); returns at once, the connecting happens in greenlets.

        Called while the run's plan holds every request (``workers/gate.py``): the first wave then
        leaves without connecting. A request costs ~0.6 ms of this process's CPU to leave, a third
        of it the connect (a TLS handshake to OpenRouter costs more), and a held worker has a
        thousand of them to send at once (measured: 1,000 requests in flight in 0.34–0.37 s from a
        warmed pool, 0.47–0.71 s from an empty one, one process against the simulator)."""
        pool: Any = self._adapter.get_connection_with_tls_context(self._template(), self._verify,
                                                                   self._session.proxies)
        slots = pool.pool
        if slots is None:  # closed
            return
        with _locked(slots):
            idle = sum(conn is not None for conn in slots.queue)
        for _ in range(min(connections, self._pool_size) - idle - self._warming):
            self._warming += 1
            gevent.spawn(self._open_one, pool)

    def _open_one(self, pool: Any) -> None:
        """One new connection into the pool's idle ones. urllib3's pool is a LIFO queue that starts
        full of ``None`` (a slot for a connection not made yet): one ``None`` makes room for it, so
        the pool never holds more than its size, and the requests that follow pop it first."""
        try:
            slots = pool.pool
            if slots is None:
                return
            with _locked(slots):
                if None not in slots.queue:  # every slot holds a connection already
                    return
                slots.queue.remove(None)
            conn = pool._new_conn()
            try:
                conn.connect()
            except OSError:
                conn.close()
                conn = None  # the slot goes back empty: the request will connect (and say why)
            pool._put_conn(conn)
        finally:
            self._warming -= 1

    def _body(self, request: Request) -> dict[str, Any]:
        return request_body(request)

    def _parse(self, resp: requests.Response, model: str) -> Answer:
        status = resp.status_code
        retry_after_s = parse_retry_after_s(resp.headers.get("Retry-After"))
        try:
            body = resp.json()
        except ValueError:
            body = None
        if status != 200:
            _, message = _error_of(body)
            message = message or resp.text[:200]
            reason = f"http_{status}"
            if status in _RETRYABLE_STATUSES or (status == 402 and retry_after_s is not None):
                raise RetryableUpstreamError(reason, message, status=status, retry_after_s=retry_after_s)
            if status in (401, 402):
                raise AccountRefusedError(reason, message, status=status)
            if status == 404 or (status == 400 and _NO_SUCH_MODEL.search(message)):
                raise MisconfiguredError(reason, message, status=status, target=f"{self.url} with model {model!r}")
            raise FatalUpstreamError(reason, message, status=status)
        if not isinstance(body, dict):
            raise RetryableUpstreamError("bad_json", "200 with a body that is not a JSON object", status=200)
        code, message = _error_of(body)
        if code is not None or body.get("error"):
            # The provider failed after OpenRouter said 200 (openrouter.md: "200 with an error").
            reason = f"error200_{code}"
            if code in (400, 401, 403):
                raise FatalUpstreamError(reason, message, status=200)
            raise RetryableUpstreamError(reason, message, status=200, retry_after_s=retry_after_s,
                                         code=int(code) if str(code).isdigit() else None)
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise RetryableUpstreamError("no_choices", "200 without choices", status=200)
        choice = choices[0]
        message_obj = choice.get("message")
        if not isinstance(message_obj, dict):
            raise RetryableUpstreamError("no_message", "choice without a message", status=200)
        finish = str(choice.get("finish_reason") or "")
        if finish == "error":
            raise RetryableUpstreamError("finish_error", "generation ended with an error", status=200)
        if finish == "content_filter":
            raise FatalUpstreamError("content_filter", "the provider filtered the answer", status=200)
        if finish not in ("stop", "length", "tool_calls"):
            raise RetryableUpstreamError("bad_finish", f"finish_reason {finish!r}", status=200)
        if not (message_obj.get("content") or _has_reasoning(message_obj) or message_obj.get("tool_calls")):
            # Nothing to learn from and nothing a rebuild could check; seen when a provider drops
            # the connection after "200 OK" or ends a stream early.
            raise RetryableUpstreamError("empty_answer", f"no content, reasoning or tool calls ({finish})", status=200)
        meta: dict[str, Any] = {
            "native_finish_reason": choice.get("native_finish_reason"),
            "usage": _usage(body.get("usage")),
            "provider": str(body.get("provider") or ""),
            "model": str(body.get("model") or ""),
            "generation_id": str(body.get("id") or resp.headers.get("X-Generation-Id") or ""),
        }
        return answer_from_message(message_obj, finish, **{**meta, **self._extra_fields(body, choice, model)})

    def _extra_fields(self, body: dict[str, Any], choice: dict[str, Any], model: str) -> dict[str, Any]:
        """More ``Answer`` fields from the reply; a subclass's hook (``workers/vllm.py``'s ids)."""
        return {}


__all__ = ["OpenRouterClient", "UpstreamError", "answer_from_message", "chat_url", "parse_retry_after_s"]
