"""OpenRouter's Batch API, as ``shared/reference/openrouter.md`` ("Batch API") describes it.

Routes (``SimApp`` hands every ``/api/v1/batches…`` path here):

``POST /api/v1/batches``  ``{"endpoint": "/v1/chat/completions", "model": id, "requests":
    [{"custom_id", "body"}, …], "completion_window"?, "callback_url"?, "provider"?}``. ``endpoint``
    and ``model`` must come before ``requests`` in the JSON text (400 otherwise: the real server
    parses the body as a stream). At most ``MAX_REQUESTS`` requests and ``MAX_BATCH_BYTES`` bytes;
    a model with no ``:batch`` variant (``batch_models``) is refused: 400 "Model '<id>' does not have
    a :batch endpoint". Answers **202** with the batch object, ``status: "validating"``. The 202 only
    means stored: an invalid request (no messages, prompt + max_tokens over the context, another
    model, a duplicate or missing custom_id) fails the **whole batch** after ``batch_validate_s``,
    ``error.message`` naming its custom_id; nothing of it runs or is billed.
``GET /api/v1/batches/{id}``  the batch: ``status`` (validating → in_progress → finalizing →
    completed; failed; expired), ``request_counts {total, completed, failed}``, ``usage`` (prompt and
    completion tokens, ``cost``: every answered request at ``batch_discount`` of the live price),
    ``error``, and ``results`` once terminal.
``GET /api/v1/batches/{id}/results?limit=&cursor=``  ``{data: [result], has_more, next_cursor}``.
``GET /api/v1/batches?after=&status=&created_after=&limit=``  newest first, without results:
    ``{data, has_more, last_id}``; ``after`` is the ``last_id`` of the page before.
``DELETE /api/v1/batches/{id}``  purges a terminal batch; 409 while it runs. There is **no cancel**
    (``POST …/cancel`` is a 404): a submitted batch runs and is billed.

``batch_submit_delay_s`` holds the 202 that long after the batch is stored: a client that gives up
first has a batch it does not know of. ``batch_submit_drop`` drops the next N POSTs unstored (their
answers held as long): a client that gives up has no batch to find. Timing (``/_sim/config``):
validating for ``batch_validate_s``, in progress for ``batch_run_s`` (answers come in evenly over
it), finalizing for ``batch_finalize_s``, then completed. A share ``batch_expire_rate`` of batches
(seeded per batch) expires instead, at ``batch_expire_done`` of its requests answered: those results
are returned and billed, the rest are not. ``batch_error_rate`` (seeded per request) fails single
requests with ``error: {type, message}``; a completed batch holds them and they are not billed. A
``#sim`` script's ``fail_attempts`` naming a status fails the request the same way (its first
entry).

One result: ``{id, custom_id, response: {status_code, request_id, body: <chat.completion, id
"gen-batch-…", usage without cost>} | null, error: {type, message} | null}``. The per-result cost is
not documented upstream, so none is given: the batch's ``usage.cost`` is the charge.

``GET /_sim/batches``: ``{batches, by_status, submitted_custom_ids, repeated_custom_ids: {custom_id:
times} (submitted in more than one batch), billed_cost_usd, results}``. Advancing is lazy: every
batch route and ``/_sim/batches`` brings each open batch up to date with the clock.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import gevent

from simulator.billing import BilledUsage, GenerationRecord, Ledger
from simulator.engine import generate
from simulator.faults import error_body
from simulator.kimi import render_prompt
from simulator.models import context_error_message
from simulator.request import BadRequest, ChatRequest, parse_chat_request
from simulator.script import find_script
from simulator.seeding import rng_for
from simulator.settings import SimSettings
from simulator.tokens import TokenCounter
from simulator.wire import completion_body

PATH = "/api/v1/batches"
ENDPOINT = "/v1/chat/completions"
MAX_REQUESTS = 5_000
MAX_BATCH_BYTES = 200 * 1024 * 1024
MAX_CUSTOM_ID_CHARS = 64
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
#: Results generated between two yields to the hub while a batch catches up with the clock.
_YIELD_EVERY = 100
_PAGE_MAX = 1000

StartResponse = Callable[..., Any]


def has_batch_variant(model: str, s: SimSettings) -> bool:
    base = model.removesuffix(":batch")
    if base not in s.served_models:
        return False
    return "*" in s.batch_models or base in s.batch_models


@dataclass
class Batch:
    id: str
    model: str
    requests: list[dict[str, Any]]
    created_at: float
    completion_window: str
    invalid: str | None  # why validation fails it (naming the custom_id), decided at submission
    expires: bool
    status: str = "validating"
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    ended_at: float | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    usage: BilledUsage = field(default_factory=BilledUsage)
    advancing: bool = False

    def to_json(self, *, with_results: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": ENDPOINT, "model": self.model,
            "status": self.status, "completion_window": self.completion_window,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at,
            "finalizing_at": self.finalizing_at,
            f"{self.status}_at" if self.status in TERMINAL else "ended_at": self.ended_at,
            "request_counts": {"total": len(self.requests), "completed": self.completed,
                               "failed": self.failed},
            "usage": {"prompt_tokens": self.usage.prompt_tokens,
                      "completion_tokens": self.usage.completion_tokens,
                      "reasoning_tokens": self.usage.reasoning_tokens,
                      "cost": round(self.usage.cost, 12)},
            "error": {"code": 400, "message": self.invalid} if self.status == "failed" else None,
        }
        if with_results and self.status in TERMINAL:
            out["results"] = self.results
        return out


class BatchStore:
    """Every batch submitted since the start (or the last ``/_sim/reset``)."""

    def __init__(self) -> None:
        self.batches: OrderedDict[str, Batch] = OrderedDict()
        #: Batches purged by DELETE: gone from the API, still counted by ``stats`` (what was billed).
        self.deleted: dict[str, Batch] = {}
        self.submitted: Counter[str] = Counter()
        self.billed_cost = 0.0
        #: POSTs dropped unstored so far (``batch_submit_drop``).
        self.dropped_posts = 0

    # --- routes -----------------------------------------------------------------------------

    def route(self, method: str, path: str, environ: dict[str, Any], start_response: StartResponse,
              settings: SimSettings, counter: TokenCounter, ledger: Ledger,
              reply: Callable[..., list[bytes]]) -> Iterable[bytes]:
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        rest = path[len(PATH):].strip("/")
        parts = rest.split("/") if rest else []
        now = time.time()
        self._advance_all(now, settings, counter, ledger)
        if method == "POST" and not parts:
            return self._submit(environ, start_response, settings, counter, reply, now)
        if method == "GET" and not parts:
            return reply(start_response, 200, self._list(query))
        batch = self.batches.get(parts[0]) if parts else None
        if batch is None or len(parts) > 2 or (len(parts) == 2 and parts[1] != "results"):
            return reply(start_response, 404, error_body(404, f"{method} {path}: no such batch"))
        if method == "GET" and len(parts) == 1:
            return reply(start_response, 200, batch.to_json(with_results=True))
        if method == "GET":
            return reply(start_response, 200, _results_page(batch, query))
        if method == "DELETE" and len(parts) == 1:
            if batch.status not in TERMINAL:
                return reply(start_response, 409, error_body(
                    409, f"batch {batch.id} is {batch.status}: only a finished batch can be deleted "
                         "(there is no cancel)"))
            self.deleted[batch.id] = self.batches.pop(batch.id)
            return reply(start_response, 200, {"id": batch.id, "object": "batch", "deleted": True})
        return reply(start_response, 405, error_body(405, f"{method} {path}: no route"))

    def stats(self, settings: SimSettings, counter: TokenCounter, ledger: Ledger) -> dict[str, Any]:
        self._advance_all(time.time(), settings, counter, ledger)
        return {
            "batches": len(self.batches) + len(self.deleted),
            "deleted": len(self.deleted),
            "dropped_posts": self.dropped_posts,
            "by_status": dict(Counter(b.status for b in [*self.batches.values(), *self.deleted.values()])),
            "submitted_custom_ids": sum(self.submitted.values()),
            "repeated_custom_ids": {k: n for k, n in self.submitted.items() if n > 1},
            "results": sum(b.completed + b.failed for b in [*self.batches.values(), *self.deleted.values()]),
            "billed_cost_usd": round(self.billed_cost, 9),
        }

    # --- submission -------------------------------------------------------------------------

    def _submit(self, environ: dict[str, Any], start_response: StartResponse, s: SimSettings,
                counter: TokenCounter, reply: Callable[..., list[bytes]], now: float) -> list[bytes]:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return reply(start_response, 400, error_body(400, "bad Content-Length"))
        if length > MAX_BATCH_BYTES:
            return reply(start_response, 413, error_body(
                413, f"batch of {length:,} bytes is over the {MAX_BATCH_BYTES:,}-byte limit"))
        raw = bytes(environ["wsgi.input"].read(length)) if length else b""
        try:
            body, order = _parse_ordered(raw)
            model, requests = _check_envelope(body, order, s)
        except BadRequest as exc:
            return reply(start_response, 400, error_body(400, str(exc)))
        if self.dropped_posts < s.batch_submit_drop:
            self.dropped_posts += 1
            gevent.sleep(s.batch_submit_delay_s)  # lost before it was stored: its client's wait ends first
            return reply(start_response, 502, error_body(502, "the batch was not stored"))
        batch_id = f"batch_{secrets.token_hex(12)}"
        expires = rng_for(s.seed, batch_id, "batch_expire").random() < s.batch_expire_rate
        batch = Batch(id=batch_id, model=model, requests=requests, created_at=round(now, 3),
                      completion_window=str(body.get("completion_window") or "24h"),
                      invalid=_invalid(requests, model, s, counter), expires=expires)
        self.batches[batch_id] = batch
        self.submitted.update(str(r.get("custom_id")) for r in requests)
        if s.batch_submit_delay_s:
            gevent.sleep(s.batch_submit_delay_s)  # stored, billed to come, and its answer late or lost
        return reply(start_response, 202, batch.to_json(with_results=False))

    # --- time passing -----------------------------------------------------------------------

    def _advance_all(self, now: float, s: SimSettings, counter: TokenCounter, ledger: Ledger) -> None:
        for batch in list(self.batches.values()):
            if batch.status not in TERMINAL and not batch.advancing:
                batch.advancing = True
                try:
                    self._advance(batch, now, s, counter, ledger)
                finally:
                    batch.advancing = False

    def _advance(self, b: Batch, now: float, s: SimSettings, counter: TokenCounter, ledger: Ledger) -> None:
        started = b.created_at + s.batch_validate_s
        if now < started:
            return
        if b.invalid is not None:
            b.status, b.ended_at = "failed", started
            return
        b.status, b.in_progress_at = "in_progress", b.in_progress_at or started
        total = len(b.requests)
        share = 1.0 if s.batch_run_s <= 0 else min(1.0, (now - started) / s.batch_run_s)
        if b.expires:
            share = min(share, s.batch_expire_done)
        due = int(total * share)
        while b.completed + b.failed < due:
            self._answer(b, b.requests[b.completed + b.failed], s, counter, ledger, now)
            if (b.completed + b.failed) % _YIELD_EVERY == 0:
                gevent.sleep(0)
        run_end = started + s.batch_run_s
        if b.expires and now >= run_end:
            b.status, b.ended_at = "expired", run_end
            return
        if now < run_end:
            return
        b.status, b.finalizing_at = "finalizing", run_end
        if now >= run_end + s.batch_finalize_s:
            b.status, b.ended_at = "completed", run_end + s.batch_finalize_s

    def _answer(self, b: Batch, item: dict[str, Any], s: SimSettings, counter: TokenCounter, ledger: Ledger,
                now: float) -> None:
        custom_id = str(item["custom_id"])
        req = _request(item, b.model)
        script = find_script(req.messages)
        rng = rng_for(s.seed, req.prompt_hash, "batch_error")
        scripted_fault = script.fail_attempts[0] if script is not None and script.fail_attempts else None
        if scripted_fault is not None or rng.random() < s.batch_error_rate:
            b.failed += 1
            b.results.append({"id": f"batch_req_{secrets.token_hex(8)}", "custom_id": custom_id, "response": None,
                              "error": {"type": "provider_error", "code": str(scripted_fault or 502),
                                        "message": "Provider returned error"}})
            return
        gen = generate(req, s, script, counter)
        full = gen.usage
        usage = BilledUsage(full.prompt_tokens, full.completion_tokens, full.reasoning_tokens, full.cached_tokens,
                            round(full.cost * s.batch_discount, 12))
        gen_id = f"gen-batch-{int(now)}-{secrets.token_urlsafe(12)}"
        provider = rng_for(s.seed, req.prompt_hash, "batch_provider").choice(s.providers)
        body = completion_body(gen_id=gen_id, created=int(now), model=b.model, provider=provider,
                               answer=gen.answer, usage=usage)
        body["usage"].pop("cost", None)  # not documented per result: the batch's usage.cost is the charge
        b.completed += 1
        b.results.append({"id": f"batch_req_{secrets.token_hex(8)}", "custom_id": custom_id,
                          "response": {"status_code": 200, "request_id": gen_id, "body": body}, "error": None})
        b.usage = BilledUsage(b.usage.prompt_tokens + usage.prompt_tokens,
                              b.usage.completion_tokens + usage.completion_tokens,
                              b.usage.reasoning_tokens + usage.reasoning_tokens, 0, b.usage.cost + usage.cost)
        self.billed_cost += usage.cost
        ledger.bill(GenerationRecord(
            id=gen_id, prompt_hash=req.prompt_hash, model=b.model, provider=provider, usage=usage,
            finish_reason=gen.answer.finish_reason, native_finish_reason=gen.answer.native_finish_reason,
            fault=None, streamed=False, abandoned=False, latency_ms=(now - b.created_at) * 1000, created=now,
            ended_mono=time.monotonic()))

    # --- listing ----------------------------------------------------------------------------

    def _list(self, query: dict[str, str]) -> dict[str, Any]:
        newest_first = list(reversed(self.batches.values()))
        if after := query.get("after"):
            ids = [b.id for b in newest_first]
            newest_first = newest_first[ids.index(after) + 1:] if after in ids else []
        if status := query.get("status"):
            newest_first = [b for b in newest_first if b.status == status]
        if created_after := query.get("created_after"):
            since = float(created_after)
            newest_first = [b for b in newest_first if b.created_at >= since]
        limit = min(_PAGE_MAX, int(query.get("limit") or 100))
        page = newest_first[:limit]
        return {"object": "list", "data": [b.to_json(with_results=False) for b in page],
                "has_more": len(newest_first) > limit, "last_id": page[-1].id if page else None}


def _parse_ordered(raw: bytes) -> tuple[dict[str, Any], list[str]]:
    """The body and the order of its top-level keys (the last object the decoder closes)."""
    order: list[str] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        order[:] = [k for k, _ in pairs]
        return dict(pairs)

    try:
        body = json.loads(raw, object_pairs_hook=hook)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body, order


def _check_envelope(body: dict[str, Any], order: list[str], s: SimSettings) -> tuple[str, list[dict[str, Any]]]:
    if body.get("endpoint") != ENDPOINT:
        raise BadRequest(f"endpoint: expected {ENDPOINT!r}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: expected a string")
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadRequest("requests: expected a non-empty list")
    position = {k: i for i, k in enumerate(order)}
    if max(position["endpoint"], position["model"]) > position["requests"]:
        raise BadRequest("endpoint and model must come before requests in the body (it is parsed as a stream)")
    if len(requests) > MAX_REQUESTS:
        raise BadRequest(f"a batch holds at most {MAX_REQUESTS:,} requests, this one {len(requests):,}")
    if not has_batch_variant(model, s):
        raise BadRequest(f"Model '{model.removesuffix(':batch')}' does not have a :batch endpoint")
    return model.removesuffix(":batch"), requests


def _request(item: dict[str, Any], model: str) -> ChatRequest:
    body = item.get("body")
    if not isinstance(body, dict):
        raise BadRequest("body: expected a chat completions body")
    return parse_chat_request(json.dumps(body).encode(), default_model=model)


def _invalid(requests: list[dict[str, Any]], model: str, s: SimSettings, counter: TokenCounter) -> str | None:
    """Why the whole batch fails validation, naming the first bad request's custom_id; None if valid."""
    seen: set[str] = set()
    for i, item in enumerate(requests):
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
            return f"requests[{i}]: custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters"
        if custom_id in seen:
            return f"Request {custom_id}: custom_id is not unique in the batch"
        seen.add(custom_id)
        try:
            req = _request(item, model)
        except BadRequest as exc:
            return f"Request {custom_id}: {exc}"
        if req.model.removesuffix(":batch") != model:
            return f"Request {custom_id}: model {req.model!r} is not the batch's {model!r}"
        if req.stream:
            return f"Request {custom_id}: stream is not supported in a batch"
        prompt_tokens = counter.count(render_prompt(req.messages, req.tools))
        wanted = req.max_tokens or 0
        if prompt_tokens + wanted > s.context_length:
            return f"Request {custom_id}: {context_error_message(s, prompt_tokens, wanted)}"
    return None


def _results_page(batch: Batch, query: dict[str, str]) -> dict[str, Any]:
    if batch.status not in TERMINAL:
        return {"object": "list", "data": [], "has_more": False, "next_cursor": None}
    try:
        start = int(query.get("cursor") or 0)
        limit = max(1, min(_PAGE_MAX, int(query.get("limit") or 100)))
    except ValueError:
        start, limit = 0, 100
    page = batch.results[start:start + limit]
    more = start + limit < len(batch.results)
    return {"object": "list", "data": page, "has_more": more, "next_cursor": str(start + limit) if more else None}
