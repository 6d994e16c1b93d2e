"""OpenRouter's Batch API as a worker calls it (shared/reference/openrouter.md "Batch API").

``submit`` posts one batch (``endpoint`` and ``model`` before ``requests`` in the JSON text: the
server parses it as a stream); ``get`` reads its status; ``results`` pages its results; ``listed``
finds batches created after a time (the recovery of a POST whose answer was lost: never post again
before looking); ``delete`` purges a settled batch. A result's body is a chat completion, read by
the live client's own parser, so a batch answer and a live one become the same ``Answer``.

Submission is not idempotent: a 4xx means no batch (``BatchRefused``); any other failure may have
created one (``BatchSubmitError``), and the caller must look before posting again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import requests

from common.endpoints import Endpoints
from common.errors import BatchRefused, BatchSubmitError, UpstreamError
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Answer

ENDPOINT = "/v1/chat/completions"
READ_TIMEOUT_S = 30.0
RESULTS_PAGE = 500
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


class BatchClient:
    """One per worker process."""

    def __init__(self, base_url: str, api_key: str, *, app_url: str, app_title: str,
                 submit_timeout_s: float) -> None:
        self.url = Endpoints.of(base_url).batches
        #: A POST of a large batch uploads up to 200 MB: its own, longer deadline.
        self.submit_timeout_s = submit_timeout_s
        self._session = requests.Session()
        self._session.trust_env = False
        self._session.headers.update({"Authorization": f"Bearer {api_key}", "HTTP-Referer": app_url,
                                      "X-Title": app_title, "Content-Type": "application/json"})
        # The live client's reply parser, for result bodies (the same classification of every answer).
        self._parser = OpenRouterClient(base_url, api_key, pool_size=1, app_url=app_url, app_title=app_title)

    def submit(self, model: str, requests_: list[dict[str, Any]]) -> dict[str, Any]:
        """The batch object of a new batch. ``requests_``: ``[{"custom_id", "body"}]``."""
        body = orjson.dumps({"endpoint": ENDPOINT, "model": model, "requests": requests_})
        try:
            resp = self._session.post(self.url, data=body, timeout=self.submit_timeout_s)
        except requests.RequestException as exc:
            raise BatchSubmitError(f"POST {self.url}: {type(exc).__name__}") from None
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            raise BatchRefused(resp.status_code, _message(resp))
        if resp.status_code not in (200, 201, 202):
            raise BatchSubmitError(f"POST {self.url}: HTTP {resp.status_code}: {_message(resp)}")
        batch: dict[str, Any] = resp.json()
        return batch

    def get(self, batch_id: str) -> dict[str, Any]:
        resp = self._session.get(f"{self.url}/{batch_id}", timeout=READ_TIMEOUT_S)
        resp.raise_for_status()
        batch: dict[str, Any] = resp.json()
        return batch

    def delete(self, batch_id: str) -> None:
        """Purge a terminal batch (its stored requests and results) at OpenRouter; 409 while it runs."""
        resp = self._session.delete(f"{self.url}/{batch_id}", timeout=READ_TIMEOUT_S)
        resp.raise_for_status()

    def results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        cursor = ""
        while True:
            resp = self._session.get(f"{self.url}/{batch_id}/results", timeout=READ_TIMEOUT_S,
                                     params={"limit": str(RESULTS_PAGE), **({"cursor": cursor} if cursor else {})})
            resp.raise_for_status()
            page = resp.json()
            yield from page.get("data") or []
            if not page.get("has_more") or not page.get("next_cursor"):
                return
            cursor = str(page["next_cursor"])

    def listed(self, created_after: float) -> list[dict[str, Any]]:
        """Every batch created at or after ``created_after`` (unix seconds), newest first."""
        out: list[dict[str, Any]] = []
        after = ""
        while True:
            params = {"created_after": f"{created_after:.3f}", "limit": "100", **({"after": after} if after else {})}
            resp = self._session.get(self.url, params=params, timeout=READ_TIMEOUT_S)
            resp.raise_for_status()
            page = resp.json()
            out += page.get("data") or []
            if not page.get("has_more") or not page.get("last_id"):
                return out
            after = str(page["last_id"])

    def answer(self, result: dict[str, Any], model: str) -> Answer:
        """One result as the live path's ``Answer``; raises the ``UpstreamError`` the live client
        would for the same reply (an error result is its status' error)."""
        response = result.get("response")
        if result.get("error") is not None or not isinstance(response, dict):
            error = result.get("error") or {}
            raise UpstreamError(f"batch_{error.get('type') or 'error'}", str(error.get("message") or "no response"))
        raw = orjson.dumps(response.get("body") or {})
        return self._parser._parse(int(response.get("status_code") or 200), {}, raw, model)


def _message(resp: requests.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


__all__ = ["TERMINAL", "BatchClient"]
