"""OpenRouter as an ``Upstream``: one chat-completions attempt per call, every failure classified.

``complete`` turns a ``Request`` into the JSON body, posts it and parses the reply into an
``Answer`` (the reasoning/content/tool-call parts of ``choices[0].message``, billed usage,
provider, generation id) or raises the error class that says what to do:
``RetryableUpstreamError`` (408, 429, 5xx, bad JSON, 200-with-error; ``UpstreamTimeoutError`` when
``timeout_s`` passed before the whole answer was in; ``InFlightBudgetError`` for the account's
in-flight budget), ``WeightExceedsBudgetError`` (one request over the whole balance),
``AccountRefusedError`` (401, any other 402), ``MisconfiguredError`` (404, or a 400
saying the model does not exist or has no endpoints) and ``FatalUpstreamError`` (anything else a
retry cannot fix; ``AnswerTooLargeError`` for a body over ``max_answer_bytes``, with the usage
its tail says was billed). Retrying is the caller's job
(``workers/pipeline/retry.py`` decides on the class; ``workers/pipeline/job.py`` renews the lease between
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

from common.contract import FAIL_ANSWER_TOO_LARGE, Usage
from common.endpoints import OPENROUTER_ROOT, Endpoints
from common.errors import (
    AccountRefusedError,
    AnswerTooLargeError,
    FatalUpstreamError,
    InFlightBudgetError,
    MisconfiguredError,
    RetryableUpstreamError,
    UpstreamError,
    UpstreamTimeoutError,
    WeightExceedsBudgetError,
)
from workers.upstreams.upstream import Answer, Request

#: Connecting may take this long at most (and never more than the attempt's ``timeout_s``).
CONNECT_TIMEOUT_S = 10.0
#: What one read of the body asks for: a large answer is read in pieces, its size checked on the way.
READ_CHUNK_BYTES = 64 * 1024
#: Of an answer too large to keep, the last bytes kept to read its usage from.
TAIL_BYTES = 64 * 1024
# Statuses a later attempt can fix (openrouter.md "Errors"); 402 only with Retry-After.
_RETRYABLE_STATUSES = {408, 429, 500, 502, 503, 504, 520, 522, 524, 529}
#: How a 402 names the account's in-flight budget (openrouter.md "The in-flight spending budget").
IN_FLIGHT_BUDGET_REASON = "in_flight_budget_exhausted"
IN_FLIGHT_BUDGET_SOURCE = "openrouter_in_flight_budget"
WEIGHT_EXCEEDS_BUDGET_REASON = "weight_exceeds_budget"
#: The in-flight budget's 402 always carries Retry-After; should one come without, wait this long.
IN_FLIGHT_RETRY_AFTER_S = 1.0
#: How OpenRouter (and OpenAI-style servers) say the model id is wrong: the run file's fault.
_NO_SUCH_MODEL = re.compile(r"no endpoints found|not a valid model|model .*not (be )?found|model_not_found|"
                            r"does not exist|unknown model", re.IGNORECASE)


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


def _error_metadata(body: Any) -> dict[str, Any]:
    err = body.get("error") if isinstance(body, dict) else None
    meta = err.get("metadata") if isinstance(err, dict) else None
    return meta if isinstance(meta, dict) else {}


def _payment_required(body: Any, message: str, retry_after_s: float | None, max_tokens: int) -> UpstreamError:
    """A 402, read by ``error.metadata.reason`` / ``limit_source`` rather than its status
    (openrouter.md): the in-flight budget (a fleet signal), one request over the whole balance (the
    prompt fails), or the account out of money (the fleet halts). A 402 naming neither but carrying
    ``Retry-After`` is the in-flight budget, as the older docs describe it."""
    meta = _error_metadata(body)
    why, source = meta.get("reason"), meta.get("limit_source")
    if why == IN_FLIGHT_BUDGET_REASON or source == IN_FLIGHT_BUDGET_SOURCE or (
            why is None and source is None and retry_after_s is not None):
        return InFlightBudgetError(IN_FLIGHT_BUDGET_REASON, message, status=402,
                                   retry_after_s=IN_FLIGHT_RETRY_AFTER_S if retry_after_s is None else retry_after_s)
    if why == WEIGHT_EXCEEDS_BUDGET_REASON:
        return WeightExceedsBudgetError(
            WEIGHT_EXCEEDS_BUDGET_REASON,
            f"one request's worst case (its prompt + max_tokens {max_tokens:,} at the model's price) exceeds the "
            f"account's whole balance: lower max_tokens of its length class, or add credits ({message})", status=402)
    return AccountRefusedError("http_402", message, status=402)


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


def _loads(raw: bytes | bytearray) -> Any:
    """The body's JSON, or None. orjson parses the bytes as they came (``resp.json()`` decoded
    them to a str first: a second copy of a large answer, four bytes a character past Latin-1)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:  # an integer past 64 bits, which orjson refuses and the standard parser takes
        return json.loads(raw)
    except ValueError:
        return None


def _read_body(resp: requests.Response, *, max_bytes: int | None, until: float) -> bytearray:
    """The whole body, read in chunks against the attempt's deadline ``until`` (monotonic).

    Over ``max_bytes`` the rest is read and dropped, keeping only its last ``TAIL_BYTES``, where a
    chat answer says what it was billed (``usage`` comes last): ``AnswerTooLargeError`` then
    carries that usage, so the money is counted though the answer is not kept."""
    declared = resp.headers.get("Content-Length")
    over = max_bytes is not None and declared is not None and declared.isdigit() and int(declared) > max_bytes
    buf = bytearray()
    size = 0
    # requests' iterator, not urllib3's: it turns a read timeout or a connection broken mid-body
    # into requests' exceptions, which complete() classifies.
    for chunk in resp.iter_content(READ_CHUNK_BYTES):
        size += len(chunk)
        if time.monotonic() > until:
            raise requests.Timeout()
        if over:
            buf = (buf + chunk)[-TAIL_BYTES:]
            continue
        buf += chunk
        if max_bytes is not None and size > max_bytes:
            over = True
            buf = buf[-TAIL_BYTES:]
    if over:
        raise AnswerTooLargeError(
            FAIL_ANSWER_TOO_LARGE,
            f"the answer is {size:,} bytes, over SPECFLEET_MAX_ANSWER_BYTES = {max_bytes:,}: billed, not kept",
            status=resp.status_code, usage=_usage_in_tail(buf))
    return buf


def _usage_in_tail(tail: bytes | bytearray) -> Usage | None:
    """The ``usage`` object of a JSON body's last bytes (None if they hold none)."""
    text = bytes(tail).decode("utf-8", "replace")
    at = text.rfind('"usage"')
    if at < 0:
        return None
    start = text.find("{", at)
    if start < 0:
        return None
    try:
        raw, _ = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return _usage(raw)


def _locked(slots: Any) -> Any:
    """The standard library's queue guards its list with a mutex; gevent's (the queue urllib3 gets
    in a monkey-patched worker) has none and needs none: greenlets switch only where they wait."""
    mutex = getattr(slots, "mutex", None)
    return mutex if mutex is not None else contextlib.nullcontext()


class OpenRouterClient:
    """One per worker process: a pooled ``requests.Session`` sized to the greenlet count."""

    #: The API root under a bare host (``common/endpoints.py``): OpenRouter's layout.
    BARE_ROOT = OPENROUTER_ROOT

    def __init__(
        self, base_url: str, api_key: str, *, pool_size: int, app_url: str, app_title: str
    ) -> None:
        self.url = Endpoints.of(base_url, bare_root=self.BARE_ROOT).chat
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
        """One attempt, bounded as a whole by ``request.timeout_s``: connect, headers and the full
        body, however slowly its bytes come (a per-read socket timeout alone never trips on an
        upstream sending a byte a second). In a gevent worker the deadline is a ``gevent.Timeout``,
        which interrupts whatever socket wait the attempt is in; a connection it cuts is closed,
        never put back half-read (urllib3 closes a connection whose request or read did not end
        cleanly). Outside gevent the body's chunk loop checks the same deadline."""
        timeout_s = request.timeout_s
        body = _dumps(self._body(request))
        deadline = gevent.Timeout(timeout_s)
        deadline.start()
        try:
            status, headers, raw = self._post(body, timeout_s=timeout_s, max_bytes=request.max_answer_bytes,
                                              until=time.monotonic() + timeout_s)
        except gevent.Timeout as exc:
            if exc is not deadline:
                raise
            raise UpstreamTimeoutError("timeout", f"no complete answer within {timeout_s:g} s") from None
        except requests.Timeout:
            raise UpstreamTimeoutError("timeout", f"no complete answer within {timeout_s:g} s") from None
        except requests.ConnectionError as exc:
            raise RetryableUpstreamError("connection", type(exc).__name__) from None
        except requests.RequestException as exc:
            raise RetryableUpstreamError("transport", type(exc).__name__) from None
        finally:
            deadline.close()
        return self._parse(status, headers, raw, request.model, max_tokens=request.max_tokens)

    def _post(self, body: bytes, *, timeout_s: float, max_bytes: int | None,
              until: float) -> tuple[int, Any, bytearray]:
        """One POST through the session's adapter, from a request the session prepared once; the
        status, headers and body.

        ``Session.post`` would merge the session's settings, cookies and hooks again on every call
        (9% of a busy worker) for a URL and headers that never change, and would follow redirects,
        which an API answers with only when its URL is wrong (here: a non-200, said as such)."""
        prepared = self._template().copy()
        prepared.body = body
        prepared.headers["Content-Length"] = str(len(body))
        resp = self._adapter.send(prepared, stream=True, timeout=(min(CONNECT_TIMEOUT_S, timeout_s), timeout_s),
                                  verify=self._verify, proxies=self._session.proxies)
        try:
            raw = _read_body(resp, max_bytes=max_bytes, until=until)
        except BaseException:
            resp.close()  # a body not read to its end: the connection is closed, its slot freed
            raise
        # Read to its end: urllib3 has put the connection back in the pool for the next request.
        return resp.status_code, resp.headers, raw

    def _template(self) -> requests.PreparedRequest:
        if self._prepared is None:  # first use: a subclass may have changed the headers meanwhile
            self._prepared = self._session.prepare_request(requests.Request("POST", self.url, data=b""))
        return self._prepared

    def warm(self, connections: int) -> None:
        """Open connections ahead of the requests that will use them, up to ``connections`` idle
        ones (and the pool's size); returns at once, the connecting happens in greenlets.

        Called while the run's plan holds every request (``workers/fleet/gate.py``): the first wave then
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

    def _parse(self, status: int, headers: Any, raw: bytes | bytearray, model: str, *, max_tokens: int = 0) -> Answer:
        retry_after_s = parse_retry_after_s(headers.get("Retry-After"))
        body = _loads(raw)
        if status != 200:
            _, message = _error_of(body)
            message = message or bytes(raw[:200]).decode("utf-8", "replace")
            reason = f"http_{status}"
            if status == 402:
                raise _payment_required(body, message, retry_after_s, max_tokens)
            if status in _RETRYABLE_STATUSES:
                raise RetryableUpstreamError(reason, message, status=status, retry_after_s=retry_after_s)
            if status == 401:
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
            "generation_id": str(body.get("id") or headers.get("X-Generation-Id") or ""),
        }
        return answer_from_message(message_obj, finish, **{**meta, **self._extra_fields(body, choice, model)})

    def _extra_fields(self, body: dict[str, Any], choice: dict[str, Any], model: str) -> dict[str, Any]:
        """More ``Answer`` fields from the reply; a subclass's hook (``workers/upstreams/vllm.py``'s ids)."""
        return {}


__all__ = ["OpenRouterClient", "UpstreamError", "answer_from_message", "parse_retry_after_s"]
