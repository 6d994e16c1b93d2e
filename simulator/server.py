"""The WSGI application: routes, the chat flow (auth, faults, timing, billing), streaming.

One gevent hub serves every connection (see ``run.py``); latency is ``gevent.sleep``, so thousands
of requests wait at once on a single core. All state (settings, ledger, attempt counts) is touched
only from that hub, which is why none of it is locked.
"""

from __future__ import annotations

import hmac
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

import gevent

from simulator.account import InFlightBudget, credits_reply, estimate_usd
from simulator.batch import PATH as BATCHES_PATH
from simulator.batch import BatchStore
from simulator.billing import BilledUsage, GenerationRecord, Ledger, priced
from simulator.capacity import IN_FLIGHT
from simulator.engine import Generation, base_latency_ms, generate
from simulator.engine_ids import EngineIdsError
from simulator.faults import HTTP_FAULTS, AttemptBook, error_body, http_error, pick_fault
from simulator.kimi import render_prompt
from simulator.models import (
    context_error_message,
    distillable,
    endpoints_json,
    models_json,
    no_endpoints_message,
    not_distillable_message,
)
from simulator.providers import NoProvider
from simulator.providers import choose as choose_provider
from simulator.request import BadRequest, ChatRequest, parse_chat_request
from simulator.script import Script, find_script
from simulator.seeding import rng_for
from simulator.settings import LEAK_IM_END, SettingsError, SimSettings
from simulator.tokens import TokenCounter, load_counter
from simulator.wire import (
    DONE,
    KEEPALIVE,
    chunk,
    completion_body,
    dumps,
    error200_body,
    sse,
    stream_deltas,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
CONNECTION_KEY = "simulator.connection"  # environ key of run._Connection: peer_gone(), drop()

StartResponse = Callable[..., Any]


class SimState:
    """What the server knows; replaced wholesale by ``POST /_sim/reset``."""

    def __init__(self, settings: SimSettings) -> None:
        self.launch_settings = settings
        self.settings = settings
        self.counter: TokenCounter = load_counter(settings.tokenizer)
        self.ledger = Ledger(settings.series_interval_s)
        self.attempts = AttemptBook()
        self.batches = BatchStore()
        self.account = InFlightBudget()

    def reset(self) -> None:
        self.settings = self.launch_settings
        self.ledger = Ledger(self.settings.series_interval_s)
        self.attempts.clear()
        self.batches = BatchStore()
        self.account = InFlightBudget()


@dataclass
class _Call:
    """One chat request's bookkeeping: in-flight count, its log line, exactly once."""

    settings: SimSettings
    ledger: Ledger
    t0: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
    gen_id: str = "-"
    status: str = "500"
    fault: str | None = None
    usage: BilledUsage = field(default_factory=BilledUsage)
    admitted: bool = False  # holds a capacity slot (capacity.py) until done
    #: The in-flight budget (account.py) holding this request's estimate until done.
    account: InFlightBudget | None = None
    estimate_usd: float = 0.0
    _done: bool = False

    def done(self) -> None:
        if self._done:
            return
        self._done = True
        if self.account is not None:
            self.account.release(self.estimate_usd)
        self.ledger.leave(self.status, self.settings.series_interval_s, admitted=self.admitted,
                          capacity_429=self.fault is not None and self.fault.startswith("capacity"))
        log.info(
            "chat %s status=%s fault=%s prompt=%d completion=%d reasoning=%d latency_ms=%.0f",
            self.gen_id, self.status, self.fault or "-", self.usage.prompt_tokens,
            self.usage.completion_tokens, self.usage.reasoning_tokens,
            (time.monotonic() - self.t0) * 1000,
        )


class _StreamBody:
    """A stream's WSGI iterable. ``close()`` always runs, even when the generator never started,
    so the request is always counted out of flight."""

    def __init__(self, events: Generator[bytes, None, object], call: _Call) -> None:
        self._events = events
        self._call = call

    def __iter__(self) -> Iterator[bytes]:
        return self._events

    def close(self) -> None:
        try:
            self._events.close()
        finally:
            self._call.done()


def _trickled(chunks: Iterator[bytes], every_s: float, for_s: float,
              peer_gone: Callable[[], bool]) -> Generator[bytes, None, bool]:
    """The bytes of ``chunks`` one at a time, ``every_s`` apart, for ``for_s`` seconds (the first
    at once, with the headers), then the rest as they come. Stops as soon as the client is gone:
    a byte written to a closed socket may still be accepted, and the request would look open
    until the next one. Returns whether every byte went out."""
    until = time.monotonic() + for_s
    first = True
    try:
        for data in chunks:
            at = 0
            while at < len(data) and time.monotonic() < until:
                if not first:
                    gevent.sleep(every_s)
                first = False
                if peer_gone():
                    return False
                yield data[at:at + 1]
                at += 1
            if at < len(data):
                yield data[at:]
        return True
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _status_line(status: int) -> str:
    return f"{status} {HTTPStatus(status).phrase}"


def _json(start_response: StartResponse, status: int, obj: Any,
          headers: Iterable[tuple[str, str]] = ()) -> list[bytes]:
    raw = dumps(obj)
    start_response(_status_line(status), [
        ("Content-Type", "application/json"), ("Content-Length", str(len(raw))), *headers,
    ])
    return [raw]


def _read_body(environ: dict[str, Any]) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise BadRequest("bad Content-Length") from None
    if length > MAX_BODY_BYTES:
        raise BadRequest("body too large")
    return bytes(environ["wsgi.input"].read(length)) if length else b""


def _auth_error(auth: str, expect_key: str | None) -> str | None:
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "No auth credentials found"
    if expect_key is not None and not hmac.compare_digest(token.encode(), expect_key.encode()):
        return "User not found."
    return None


def _new_id() -> str:
    return f"gen-{int(time.time())}-{secrets.token_urlsafe(15)}"


_ENDPOINTS_PREFIX, _ENDPOINTS_SUFFIX = "/api/v1/models/", "/endpoints"


def _endpoints_model(path: str) -> str | None:
    """``author/slug`` of ``/api/v1/models/{author}/{slug}/endpoints``, else None."""
    if not (path.startswith(_ENDPOINTS_PREFIX) and path.endswith(_ENDPOINTS_SUFFIX)):
        return None
    model_id = path[len(_ENDPOINTS_PREFIX):-len(_ENDPOINTS_SUFFIX)]
    author, sep, slug = model_id.partition("/")
    return model_id if sep and author and slug and "/" not in slug else None


def _fmt_retry_after(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


class SimApp:
    """The WSGI application."""

    def __init__(self, state: SimState) -> None:
        self.state = state
        self.routes: dict[tuple[str, str], Callable[..., Iterable[bytes]]] = {
            ("POST", "/api/v1/chat/completions"): self.chat,
            ("GET", "/api/v1/generation"): self.generation,
            ("GET", "/api/v1/key"): self.key,
            ("GET", "/api/v1/credits"): self.credits,
            ("GET", "/api/v1/models"): self.models,
            ("GET", "/_sim/stats"): self.stats,
            ("GET", "/_sim/batches"): self.batch_stats,
            ("GET", "/_sim/config"): self.get_config,
            ("POST", "/_sim/config"): self.set_config,
            ("POST", "/_sim/reset"): self.reset,
            ("GET", "/_sim/health"): self.health,
        }

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        # Taken out of the environ at once: a traceback or error log printing the environ then
        # has no key to show.
        auth = str(environ.pop("HTTP_AUTHORIZATION", ""))
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        handler = self.routes.get((method, path))
        if handler is None and method == "GET" and _endpoints_model(path):
            handler = self.endpoints
        if handler is None and (path == BATCHES_PATH or path.startswith(BATCHES_PATH + "/")):
            handler = self.batches
        if handler is None:
            known = any(p == path for _, p in self.routes)
            status = 405 if known else 404
            return _json(start_response, status, error_body(status, f"{method} {path}: no route"))
        try:
            return handler(environ, start_response, auth)
        except Exception:
            log.exception("simulator: internal error on %s %s", method, path)
            return _json(start_response, 500, error_body(500, "simulator internal error"))

    # --- OpenRouter routes ------------------------------------------------------------------

    def chat(self, environ: dict[str, Any], start_response: StartResponse,
             auth: str) -> Iterable[bytes]:
        call = _Call(self.state.settings, self.state.ledger)
        call.ledger.enter(call.settings.series_interval_s)
        streaming = False
        try:
            result = self._chat(call, environ, start_response, auth)
            streaming = isinstance(result, _StreamBody)
            return result
        finally:
            if not streaming:  # a stream counts itself out when its body closes
                call.done()

    def _chat(self, call: _Call, environ: dict[str, Any], start_response: StartResponse,
              auth: str) -> Iterable[bytes]:
        s = call.settings
        problem = _auth_error(auth, s.expect_key)
        if problem:
            call.status = "401"
            return _json(start_response, 401, error_body(401, problem))
        try:
            req = parse_chat_request(_read_body(environ), default_model=s.model)
            script = find_script(req.messages)
        except BadRequest as exc:
            call.status = "400"
            return _json(start_response, 400, error_body(400, str(exc)))
        if req.model not in s.served_models:
            # A configuration error, not the prompt's: every request for it answers the same.
            call.status = "404"
            return _json(start_response, 404, error_body(404, no_endpoints_message(req.model)))
        if (req.provider or {}).get("enforce_distillable_text") is True and not distillable(req.model, s):
            # Routed only to models whose author allows distillation: none qualifies, nothing is generated.
            call.status = "404"
            return _json(start_response, 404, error_body(404, not_distillable_message(req.model)))
        prompt_tokens = self.state.counter.count(render_prompt(req.messages, req.tools))
        wanted = req.max_tokens or 0
        if prompt_tokens + wanted > s.context_length:
            call.status = "400"
            return _json(start_response, 400, error_body(
                400, context_error_message(s, prompt_tokens, wanted)))
        estimate = estimate_usd(s, prompt_tokens, req.max_tokens)
        refusal = self.state.account.admit(s, estimate, call.ledger.billed_cost)
        if refusal is not None:
            call.status, call.fault = "402", refusal.kind
            gevent.sleep(s.error_latency_ms / 1000)
            wait = refusal.retry_after_s
            return _json(start_response, 402, refusal.body,
                         [] if wait is None else [("Retry-After", _fmt_retry_after(wait))])
        if s.balance_usd is not None:
            call.account, call.estimate_usd = self.state.account, estimate
        limit = call.ledger.admit(s)
        if limit is not None:
            return self._over_capacity(call, start_response, req, limit)
        call.admitted = True
        attempt = self.state.attempts.next(req.prompt_hash)
        # Per-attempt draws (fault, provider, latency): the n-th try of a prompt is the same in
        # every run, whatever order concurrent requests arrive in.
        rng = rng_for(s.seed, req.prompt_hash, "attempt", attempt)
        try:
            provider = (script.provider if script else None) or choose_provider(s, req.provider, rng)
        except NoProvider as exc:
            call.status = "404"
            return _json(start_response, 404, error_body(404, str(exc)))
        if script is not None:
            call.ledger.scripted += 1
        fault = call.fault = self._fault(call, req, script, attempt, rng)
        if fault is not None:
            call.ledger.faults[fault] += 1

        if fault in HTTP_FAULTS:
            retry_after = s.retry_after_s
            if script is not None and "retry_after_s" in script.given:
                retry_after = script.retry_after_s
            reply = http_error(str(fault), model=req.model, provider=provider,
                               retry_after_s=retry_after)
            gevent.sleep(s.error_latency_ms / 1000)
            headers = []
            if reply.retry_after_s is not None:
                headers.append(("Retry-After", _fmt_retry_after(reply.retry_after_s)))
            call.status = str(reply.status)
            return _json(start_response, reply.status, reply.body, headers)
        if fault == "hang_drop":
            gevent.sleep(s.hang_s)
            environ[CONNECTION_KEY].drop()
            call.status = "dropped"
            return []

        def generated() -> Generation:
            return generate(req, s, script, self.state.counter, attempt=attempt)

        # A plain answer is generated when it is due, not when its request arrives: a provider's
        # work is not the client's box's, and 2,000 requests arriving at once made this process
        # take a core for seconds on the box whose ramp it measures. Engine ids are built first:
        # a template that cannot render the prompt answers 400 at once.
        deferred = not req.stream and not req.return_token_ids and fault != "error200"
        gen = None
        if not deferred:
            try:
                gen = generated()
            except EngineIdsError as exc:
                call.status = "400"
                return _json(start_response, 400, error_body(400, str(exc)))
        call.gen_id = _new_id()
        ttft_ms = base_latency_ms(rng, s)
        if script is not None and script.latency_ms is not None:
            ttft_ms = script.latency_ms
        if fault == "hang":
            # Hold without a byte (a stream would otherwise send keep-alives), then answer.
            gevent.sleep(s.hang_s)
        if fault == "error200":
            gevent.sleep(s.error_latency_ms / 1000)
            call.status = "200"
            body = error200_body(gen_id=call.gen_id, created=int(call.created),
                                 model=req.model, provider=provider)
            return _json(start_response, 200, body, [("X-Generation-Id", call.gen_id)])
        if fault == "trickle":
            return self._trickle(call, environ, start_response, req, gen or generated(), provider,
                                 ttft_ms)
        if gen is None:
            return self._plain(call, environ, start_response, req, generated, provider, ttft_ms)
        if req.stream:
            self._start_stream(call, start_response)
            return _StreamBody(self._stream(call, req, gen, provider, ttft_ms), call)
        return self._plain(call, environ, start_response, req, lambda: gen, provider, ttft_ms)

    @staticmethod
    def _start_stream(call: _Call, start_response: StartResponse) -> None:
        start_response(_status_line(200), [
            ("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-cache"),
            ("X-Generation-Id", call.gen_id),
        ])
        call.status = "200"

    def _trickle(self, call: _Call, environ: dict[str, Any], start_response: StartResponse,
                 req: ChatRequest, gen: Generation, provider: str, ttft_ms: float) -> _StreamBody:
        """The ``trickle`` fault: the answer's headers at once, then its body one byte every
        ``trickle_every_s`` for ``trickle_s``, then the rest. A plain answer is generated (so
        billed, in full) before its first byte; a stream bills as any stream does."""
        s = call.settings
        peer_gone = environ[CONNECTION_KEY].peer_gone
        if req.stream:
            self._start_stream(call, start_response)
            events = self._stream(call, req, gen, provider, ttft_ms)
            return _StreamBody(_trickled(events, s.trickle_every_s, s.trickle_s, peer_gone), call)
        body = completion_body(gen_id=call.gen_id, created=int(call.created), model=req.model,
                               provider=provider, answer=gen.answer, usage=gen.usage, ids=gen.ids)
        raw = dumps(body)
        call.status = "200"
        start_response(_status_line(200), [
            ("Content-Type", "application/json"), ("Content-Length", str(len(raw))),
            ("X-Generation-Id", call.gen_id),
        ])

        def billed_body() -> Generator[bytes, None, None]:
            whole = False
            try:
                whole = yield from _trickled(iter([raw]), s.trickle_every_s, s.trickle_s, peer_gone)
            finally:
                # Abandoned: the client left before the last byte; billed in full all the same.
                self._bill(call, req, gen, provider, gen.usage, streamed=False, abandoned=not whole)

        return _StreamBody(billed_body(), call)

    def _over_capacity(self, call: _Call, start_response: StartResponse, req: ChatRequest,
                       limit: str) -> list[bytes]:
        s = call.settings
        call.fault = f"capacity_{limit}"  # for the log line; not one of the injected faults
        rng = rng_for(s.seed, req.prompt_hash, "capacity", call.ledger.requests)
        reply = http_error("429", model=req.model, provider=rng.choice(s.providers),
                           retry_after_s=s.capacity_retry_after_s)
        reply.body["error"]["metadata"]["raw"] = (
            f"capacity: {s.capacity_in_flight} in flight" if limit == IN_FLIGHT
            else f"capacity: {s.capacity_per_s} requests per second")
        gevent.sleep(s.error_latency_ms / 1000)
        headers = []
        if reply.retry_after_s is not None:
            headers.append(("Retry-After", _fmt_retry_after(reply.retry_after_s)))
        call.status = "429"
        return _json(start_response, 429, reply.body, headers)

    @staticmethod
    def _fault(call: _Call, req: ChatRequest, script: Script | None, attempt: int,
               rng: random.Random) -> str | None:
        s = call.settings
        if script is not None and attempt <= len(script.fail_attempts):
            fault: str | None = script.fail_attempts[attempt - 1]
        else:
            fault = pick_fault(s.rates, rng)
        if fault == "stream_error" and not req.stream:
            # Nothing to break mid-way: its share answers normally, so switching it on does not
            # change which other faults a prompt meets.
            fault = None
        if fault is None and s.credit_limit_usd is not None \
                and call.ledger.billed_cost >= s.credit_limit_usd:
            fault = "402"  # out of credits: no Retry-After
        return fault

    def _plain(self, call: _Call, environ: dict[str, Any], start_response: StartResponse,
               req: ChatRequest, generated: Callable[[], Generation], provider: str,
               ttft_ms: float) -> list[bytes]:
        s = call.settings
        gevent.sleep(ttft_ms / 1000)
        gen = generated()
        gevent.sleep(s.per_token_ms * gen.usage.completion_tokens / 1000)
        # Generated means billed, whether or not the client is still waiting (openrouter.md).
        self._bill(call, req, gen, provider, gen.usage, streamed=False,
                   abandoned=environ[CONNECTION_KEY].peer_gone())
        body = completion_body(gen_id=call.gen_id, created=int(call.created), model=req.model,
                               provider=provider, answer=gen.answer, usage=gen.usage, ids=gen.ids)
        raw = dumps(body)
        if call.fault == "bad_json":
            raw = raw[: len(raw) // 2]
        call.status = "200"
        start_response(_status_line(200), [
            ("Content-Type", "application/json"), ("Content-Length", str(len(raw))),
            ("X-Generation-Id", call.gen_id),
        ])
        return [raw]

    def _stream(self, call: _Call, req: ChatRequest, gen: Generation, provider: str,
                ttft_ms: float) -> Generator[bytes, None, None]:
        s = call.settings
        ids = (call.gen_id, int(call.created), req.model, provider)
        deltas = stream_deltas(gen.answer, s.stream_chunk_tokens, self.state.counter)
        cut = len(deltas) // 2 if call.fault in ("stream_error", "bad_json") else -1
        sent_tokens = 0
        settled = False
        first = True  # vLLM sends prompt_token_ids once, on the first chunk
        try:
            yield KEEPALIVE
            remaining_s = ttft_ms / 1000
            while remaining_s > 0:
                step = min(s.keepalive_s, remaining_s)
                gevent.sleep(step)
                remaining_s -= step
                if remaining_s > 0:
                    yield KEEPALIVE
            for i, (delta, n_tokens) in enumerate(deltas):
                if i == cut and call.fault == "stream_error":
                    settled = True
                    self._bill(call, req, gen, provider, self._partial(gen, sent_tokens, s),
                               streamed=True, abandoned=False, finish="error")
                    err = chunk(*ids, finish="error", native_finish="error")
                    err["error"] = {"code": "server_error", "message": "Provider disconnected"}
                    yield sse(err)
                    return
                gevent.sleep(s.per_token_ms * n_tokens / 1000)
                sent_tokens += n_tokens
                if delta is None:
                    continue
                event = chunk(*ids, delta=delta)
                if first and gen.ids is not None:
                    event["prompt_token_ids"] = gen.ids.prompt_ids
                first = False
                data = sse(event)
                if i == cut:  # bad_json: one chunk's JSON cut short
                    data = data[: len(data) // 2] + b"\n\n"
                yield data
            answer = gen.answer
            settled = True
            self._bill(call, req, gen, provider, gen.usage, streamed=True, abandoned=False)
            final = chunk(*ids, finish=answer.finish_reason,
                          native_finish=answer.native_finish_reason)
            if gen.ids is not None:
                if first:
                    final["prompt_token_ids"] = gen.ids.prompt_ids
                final["choices"][0]["token_ids"] = gen.ids.token_ids
            yield sse(final)
            last = chunk(*ids)
            last["choices"] = []
            last["usage"] = gen.usage.to_json()
            yield sse(last)
            yield DONE
        finally:
            if not settled:  # the client went away mid-stream (or the server is stopping)
                usage = gen.usage if s.stream_abort_billed else self._partial(gen, sent_tokens, s)
                self._bill(call, req, gen, provider, usage, streamed=True, abandoned=True)

    @staticmethod
    def _partial(gen: Generation, sent_tokens: int, s: SimSettings) -> BilledUsage:
        u = gen.usage
        return priced(u.prompt_tokens, sent_tokens, min(u.reasoning_tokens, sent_tokens),
                      u.cached_tokens, **s.prices())

    def _bill(self, call: _Call, req: ChatRequest, gen: Generation, provider: str, usage: BilledUsage,
              *, streamed: bool, abandoned: bool, finish: str | None = None) -> None:
        call.usage = usage
        if gen.answer.leak_im_end:
            call.ledger.faults[LEAK_IM_END] += 1
        call.ledger.bill(GenerationRecord(
            id=call.gen_id,
            prompt_hash=req.prompt_hash,
            model=req.model,
            provider=provider,
            usage=usage,
            finish_reason=finish or gen.answer.finish_reason,
            native_finish_reason=finish or gen.answer.native_finish_reason,
            fault=call.fault,
            streamed=streamed,
            abandoned=abandoned,
            latency_ms=(time.monotonic() - call.t0) * 1000,
            created=call.created,
            ended_mono=time.monotonic(),
            engine_ids=gen.ids is not None,
            noncanonical=gen.ids.injection.to_json() if gen.ids and gen.ids.injection else None,
        ))

    def generation(self, environ: dict[str, Any], start_response: StartResponse,
                   auth: str) -> Iterable[bytes]:
        problem = _auth_error(auth, self.state.settings.expect_key)
        if problem:
            return _json(start_response, 401, error_body(401, problem))
        gen_id = parse_qs(environ.get("QUERY_STRING", "")).get("id", [""])[0]
        record = self.state.ledger.records.get(gen_id)
        delay_s = self.state.settings.generation_delay_s
        # OpenRouter's stats lag the answer: 404 for a few seconds after the request ends.
        if record is None or time.monotonic() < record.ended_mono + delay_s:
            return _json(start_response, 404, error_body(404, f"Generation {gen_id} not found"))
        return _json(start_response, 200, {"data": record.stats_json()})

    def key(self, environ: dict[str, Any], start_response: StartResponse,
            auth: str) -> Iterable[bytes]:
        s = self.state.settings
        problem = _auth_error(auth, s.expect_key)
        if problem:
            return _json(start_response, 401, error_body(401, problem))
        used = round(self.state.ledger.billed_cost, 9)
        limit = s.credit_limit_usd
        return _json(start_response, 200, {"data": {
            "label": "sk-or-v1-sim…",
            "limit": limit,
            "limit_remaining": None if limit is None else max(0.0, limit - used),
            "usage": used,
            "is_free_tier": False,
            "rate_limit": {"requests": -1, "interval": "10s"},
        }})

    def credits(self, environ: dict[str, Any], start_response: StartResponse,
                auth: str) -> Iterable[bytes]:
        s = self.state.settings
        problem = _auth_error(auth, s.expect_key)
        if problem:
            return _json(start_response, 401, error_body(401, problem))
        status, body = credits_reply(s, auth.partition(" ")[2].strip(), self.state.ledger.billed_cost)
        return _json(start_response, status, body)

    def models(self, environ: dict[str, Any], start_response: StartResponse,
               auth: str) -> Iterable[bytes]:
        return _json(start_response, 200, models_json(self.state.settings))

    def endpoints(self, environ: dict[str, Any], start_response: StartResponse,
                  auth: str) -> Iterable[bytes]:
        model_id = _endpoints_model(environ.get("PATH_INFO", "")) or ""
        found = endpoints_json(model_id, self.state.settings)
        if found is None:
            return _json(start_response, 404, error_body(404, no_endpoints_message(model_id)))
        return _json(start_response, 200, found)

    def batches(self, environ: dict[str, Any], start_response: StartResponse,
                auth: str) -> Iterable[bytes]:
        """The Batch API (``batch.py``)."""
        s = self.state.settings
        problem = _auth_error(auth, s.expect_key)
        if problem:
            return _json(start_response, 401, error_body(401, problem))
        return self.state.batches.route(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ,
                                        start_response, s, self.state.counter, self.state.ledger, _json)

    # --- control routes ---------------------------------------------------------------------

    def batch_stats(self, environ: dict[str, Any], start_response: StartResponse,
                    auth: str) -> Iterable[bytes]:
        s = self.state
        return _json(start_response, 200, s.batches.stats(s.settings, s.counter, s.ledger))

    def stats(self, environ: dict[str, Any], start_response: StartResponse,
              auth: str) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        detail = query.get("detail", ["0"])[0] not in ("", "0")
        series = query.get("series", ["0"])[0] not in ("", "0")
        try:
            since_s = float(query.get("since_s", ["0"])[0])
        except ValueError:
            return _json(start_response, 400, error_body(400, "since_s: expected a number"))
        snapshot = self.state.ledger.snapshot(detail=detail,
                                              series_since_s=since_s if series else None)
        snapshot["account"] = self.state.account.snapshot()
        return _json(start_response, 200, snapshot)

    def get_config(self, environ: dict[str, Any], start_response: StartResponse,
                   auth: str) -> Iterable[bytes]:
        return _json(start_response, 200, self.state.settings.to_json())

    def set_config(self, environ: dict[str, Any], start_response: StartResponse,
                   auth: str) -> Iterable[bytes]:
        try:
            patch = json.loads(_read_body(environ) or b"{}")
            self.state.settings = self.state.settings.updated(patch)
        except (BadRequest, SettingsError, ValueError) as exc:
            return _json(start_response, 400, error_body(400, str(exc)))
        log.info("simulator settings updated: %s", sorted(patch))
        return _json(start_response, 200, self.state.settings.to_json())

    def reset(self, environ: dict[str, Any], start_response: StartResponse,
              auth: str) -> Iterable[bytes]:
        self.state.reset()
        return _json(start_response, 200, {"ok": True})

    def health(self, environ: dict[str, Any], start_response: StartResponse,
               auth: str) -> Iterable[bytes]:
        return _json(start_response, 200, {"ok": True})
