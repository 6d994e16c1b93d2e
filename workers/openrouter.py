"""The OpenRouter chat-completions client: one attempt per call, every failure classified.

Retrying is the caller's job (``workers/retry.py``): between attempts it checks the dataset's stop
flag, so a stopped dataset makes no further upstream calls.
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from common.contract import Usage
from common.errors import FatalUpstreamError, RetryableUpstreamError, UpstreamError

CHAT_PATH = "/api/v1/chat/completions"
# Statuses a later attempt can fix (openrouter.md "Errors"); 402 only with Retry-After.
_RETRYABLE_STATUSES = {408, 429, 500, 502, 503, 504, 520, 522, 524, 529}


@dataclass(frozen=True)
class Completion:
    message: dict[str, Any]
    finish_reason: str
    native_finish_reason: str | None
    #: What was billed, normalised once: absent fields (some providers omit details) are 0.
    usage: Usage
    provider: str
    model: str
    generation_id: str


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


class OpenRouterClient:
    """One per worker process: a pooled ``requests.Session`` sized to the greenlet count."""

    def __init__(
        self, base_url: str, api_key: str, *, pool_size: int, app_url: str, app_title: str
    ) -> None:
        self.url = base_url.rstrip("/") + CHAT_PATH
        self._session = requests.Session()
        # Without this, requests keeps 10 sockets per host and throws the rest away after each
        # call: at 1,000 greenlets that is a TLS handshake per request.
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
        self._session.mount("https://", adapter)
        self._session.mount("http://", adapter)
        self._session.headers.update(
            {
                "Authorization": f"Bearer {api_key}",
                "HTTP-Referer": app_url,
                "X-Title": app_title,
                "X-OpenRouter-Title": app_title,
                "Content-Type": "application/json",
            }
        )

    def complete(self, body: dict[str, Any], *, timeout_s: float) -> Completion:
        try:
            resp = self._session.post(self.url, data=json.dumps(body), timeout=(10.0, timeout_s))
        except requests.Timeout:
            raise RetryableUpstreamError("timeout", f"no answer within {timeout_s:g} s") from None
        except requests.ConnectionError as exc:
            raise RetryableUpstreamError("connection", type(exc).__name__) from None
        except requests.RequestException as exc:
            raise RetryableUpstreamError("transport", type(exc).__name__) from None
        return self._parse(resp)

    @staticmethod
    def _parse(resp: requests.Response) -> Completion:
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
            raise FatalUpstreamError(reason, message, status=status)
        if not isinstance(body, dict):
            raise RetryableUpstreamError("bad_json", "200 with a body that is not a JSON object", status=200)
        code, message = _error_of(body)
        if code is not None or body.get("error"):
            # The provider failed after OpenRouter said 200 (openrouter.md: "200 with an error").
            reason = f"error200_{code}"
            if code in (400, 401, 403):
                raise FatalUpstreamError(reason, message, status=200)
            raise RetryableUpstreamError(reason, message, status=200, retry_after_s=retry_after_s)
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
        return Completion(
            message=message_obj,
            finish_reason=finish,
            native_finish_reason=choice.get("native_finish_reason"),
            usage=_usage(body.get("usage")),
            provider=str(body.get("provider") or ""),
            model=str(body.get("model") or ""),
            generation_id=str(body.get("id") or resp.headers.get("X-Generation-Id") or ""),
        )


__all__ = ["Completion", "OpenRouterClient", "UpstreamError", "parse_retry_after_s"]
