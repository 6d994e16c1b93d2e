"""Python face of ``budget.lua``: the budget's policy, one method per operation, typed answers.

The only Python that names a field of the budget hashes (a test holds it to that). Workers
reserve/renew/settle/fail/release; the producer opens, reconciles, reaps, closes and reads snapshots.
Dollars travel as integer nano-dollars (``nusd``) so the sums in Redis stay exact.
"""

from __future__ import annotations

import json
import logging
import math
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from importlib.resources import files
from typing import Any, Literal, Protocol

import redis
from redis.exceptions import NoScriptError, ResponseError

from common.config import Pricing
from common.contract import HALT_MESSAGE_MAX_CHARS, Usage
from common.errors import ScriptReplyError
from common.keys import HALT, RUN_BUDGET, DatasetKeys
from common.outcomes import REPLIES, Outcome
from common.redis_client import fence_command, fence_failed
from common.stats import answer_counts, queue_answered

log = logging.getLogger(__name__)

_SCRIPT = files("common").joinpath("budget.lua").read_text(encoding="utf-8")

#: Every field of the dataset budget hash and the run budget hash (see budget.lua's header).
FIELDS = (
    "tokens_rule", "tokens_limit", "tokens_kept", "tokens_kept_sq", "tokens_held", "tokens_max_seen", "rows_kept",
    "nusd_limit", "nusd_spent", "nusd_held", "nusd_orphaned", "admission_state", "ended_by", "round_leases",
    "round_held", "round_margin", "round_z", "round_worst",
)

Mode = Literal["hard", "projected"]

NUSD_PER_USD = 1_000_000_000


def reply_outcome(op: str, word: str) -> Outcome:
    """budget.lua's reply word for ``op`` as its member (common/outcomes.py's ``REPLIES``);
    ``ScriptReplyError`` (a ValueError) for a word ``op`` does not answer (a script newer than the table)."""
    if word not in REPLIES[op]:
        raise ScriptReplyError(f"budget.lua {op} answered {word!r}, not one of {sorted(REPLIES[op])}")
    return Outcome(word)


def to_nusd(usd: float) -> int:
    return round(usd * NUSD_PER_USD)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Price:
    """The model's price, as OpenRouter's models endpoint gives it: USD per token, per request."""

    prompt: float
    completion: float
    request: float = 0.0

    @classmethod
    def of(cls, pricing: Pricing | None) -> Price | None:
        """``model.pricing`` of the worker view, or None when the price is unknown."""
        if pricing is None:
            return None
        return cls(pricing.prompt, pricing.completion, pricing.request)


@dataclass(frozen=True)
class Ask:
    """What one request asks the budget for: its worst case, and the prior of the projected rule."""

    worst_tokens: int
    worst_nusd: int
    prior_tokens: int


@dataclass(frozen=True)
class BudgetPolicy:
    """Every constant of the budget rule, in one place (budget.lua's header states the rule).

    ``hard`` admits a request only while the kept tokens (dollars spent) plus the worst case of
    every request in flight fit the limit, so nothing lands over it; ``projected`` admits on an
    estimate that moves from a prior to the measured mean and can end slightly over or under.
    """

    #: How many kept rows the prior estimate weighs as (projected rule); after a few times this
    #: many rows the estimate is the measured mean.
    prior_weight_rows: int = 2
    #: Kept rows after which the estimate is trusted to declare the budget full (projected rule);
    #: before, a full budget makes requests wait for in-flight ones to land.
    trust_rows: int = 20
    #: A batch round's statistical hold (hard rule, budget.lua): held for n requests of a round is
    #: n x the kept mean plus this many deviations of their sum (and of the mean's own error). 4: a
    #: round overruns it about once in 30,000 (a normal tail); an overrun's rows are billed and
    #: discarded, never kept over the cap.
    batch_hold_z: float = 4.0
    #: Kept rows before a batch round holds on them. With the margin's deviation at least 10% of the
    #: worst case, 50 rows kept no second round over its margin in 1,600 runs of answers whose tail
    #: (one in 30 to one in 100 cut at max_tokens) the first rows may not show.
    batch_hold_rows: int = 50
    #: Tokens a rebuilt turn may count beyond the provider's completion tokens (``</think>``,
    #: ``<|im_end|>``, re-tokenization): part of the hard rule's worst case.
    turn_overhead_tokens: int = 16
    #: Margin on our count of prompt tokens for the worst-case cost: the provider counts its own.
    prompt_slack_fraction: float = 0.02
    prompt_slack_tokens: int = 32
    #: How often a request parked by a full budget ("wait") asks again, in seconds (jittered ±50%).
    wait_poll_s: float = 1.0
    #: Projected rule: a stopped dataset gets a top-up round while the room left once in-flight
    #: work landed holds at least this many mean-sized rows. The hard rule ends less than one
    #: worst case short by construction, so it never needs one.
    top_up_min_rows: float = 1.0

    def prior_tokens(self, max_tokens: int, estimate_tokens: int | None) -> int:
        """The projected rule's first estimate: the configured guess, else max_tokens (a first
        wave can't overshoot)."""
        return int(estimate_tokens or max_tokens)

    def worst_tokens(self, max_tokens: int) -> int:
        return int(max_tokens) + self.turn_overhead_tokens

    def worst_nusd(self, price: Price | None, prompt_tokens: int, max_tokens: int) -> int:
        """Worst-case cost in nano-dollars; 0 when the price is unknown (no dollar budget then)."""
        if price is None:
            return 0
        prompt = math.ceil(prompt_tokens * (1 + self.prompt_slack_fraction)) + self.prompt_slack_tokens
        usd = prompt * price.prompt + max_tokens * price.completion + price.request
        return math.ceil(usd * NUSD_PER_USD)

    def ask(self, *, max_tokens: int, estimate_tokens: int | None, prompt_tokens: int,
            price: Price | None) -> Ask:
        return Ask(self.worst_tokens(max_tokens), self.worst_nusd(price, prompt_tokens, max_tokens),
                   self.prior_tokens(max_tokens, estimate_tokens))

    def row_estimate(self, snap: BudgetSnapshot, prior_tokens: int) -> float:
        """The projected rule's estimate of a row once nothing is in flight: what ``reserve`` holds
        for the next request (budget.lua: the prior weighing as prior_weight_rows rows)."""
        weight = self.prior_weight_rows
        return (prior_tokens * weight + snap.kept_tokens) / (weight + snap.rows)

    def should_top_up(self, snap: BudgetSnapshot, prior_tokens: int) -> bool:
        """After a budget stop, once nothing is in flight: is the room left worth another round?
        Judged by the estimate a request of the round is admitted against (``prior_tokens``: the
        length class's, ``prior_tokens()``), not the plain mean: between the two a round would
        admit nothing."""
        if snap.rule != "projected" or snap.ended_by != "tokens" or not snap.rows:
            return False
        return snap.limit - snap.kept_tokens >= self.top_up_min_rows * math.ceil(self.row_estimate(snap, prior_tokens))


POLICY = BudgetPolicy()


@dataclass(frozen=True)
class TurnKeep:
    """A regenerated turn kept with its row: ``record`` (msgpack {message, end}) goes to the
    conversation's turns, and ``ends`` marks the conversation ended (see keys.DatasetKeys.turns)."""

    conversation: str
    record: bytes
    ends: bool


@dataclass(frozen=True)
class Admission:
    """The budget's answer to "may this request go": ``status`` is one of ``REPLIES["reserve"]``
    (common/outcomes.py)."""

    status: Outcome
    #: Tokens held (ok/over/wait) or ms until a busy lease expires (busy); 0 otherwise.
    value: int


def _budget(hash_field: str, *, state: str | None = "") -> Any:
    """A ``BudgetSnapshot`` attribute read from the dataset's budget hash field ``hash_field``
    (budget.lua's header); ``state``: its name in the producer's ``DatasetState`` ("": the same,
    a ``_nusd`` total there in dollars as ``_usd``; None: not there)."""
    return field(metadata={"hash": "budget", "field": hash_field, "state": state})


def _run(hash_field: str, *, state: str | None = "") -> Any:
    """The same for the run's budget hash (``keys.RUN_BUDGET``)."""
    return field(metadata={"hash": "run", "field": hash_field, "state": state})


def _leases() -> Any:
    """The number of live leases (HLEN of the dataset's leases), under the same name in ``DatasetState``."""
    return field(metadata={"hash": "leases", "field": None, "state": ""})


@dataclass(frozen=True)
class BudgetSnapshot:
    """The budget's totals, each declared once with where it is read from and what the producer's
    state calls it: the reads, their decoding and ``DatasetState`` follow from these by name."""

    limit: int = _budget("tokens_limit")
    kept_tokens: int = _budget("tokens_kept")
    #: Token holds of live leases (hard: their worst cases; projected: their estimates).
    reserved_tokens: int = _budget("tokens_held")
    rows: int = _budget("rows_kept")
    state: str = _budget("admission_state")  # active | exhausted | stopped | "" (never opened)
    in_flight: int = _leases()
    rule: str = _budget("tokens_rule", state="budget_mode")
    ended_by: str = _budget("ended_by")
    limit_nusd: int = _budget("nusd_limit", state="budget_usd")  # 0: no dollar budget
    spent_nusd: int = _budget("nusd_spent")
    held_nusd: int = _budget("nusd_held")
    #: Dollars held for reaped leases whose answer may still be billed (budget.lua's orphans).
    unresolved_nusd: int = _budget("nusd_orphaned")
    run_limit_nusd: int = _run("nusd_limit", state="run_budget_usd")
    run_spent_nusd: int = _run("nusd_spent")
    run_state: str = _run("admission_state", state=None)
    #: A batch round's requests in flight and their (mean) holds (budget.lua's round hold).
    round_leases: int = _budget("round_leases", state=None)
    round_held: int = _budget("round_held", state=None)

    @property
    def run_exhausted(self) -> bool:
        return self.run_state == "exhausted"

    def expected_room_tokens(self, trust_rows: int) -> int:
        """The token room expected once what is in flight has landed: the limit less the kept
        tokens, less each request out at the kept mean (a round's at its hold, the mean it was
        admitted at). Before ``trust_rows`` rows the answers are unknown: the room less kept only."""
        room = self.limit - self.kept_tokens
        if self.rows < trust_rows or self.rows <= 0:
            return room
        mean = self.kept_tokens / self.rows
        return int(room - self.round_held - max(0, self.in_flight - self.round_leases) * mean)

    def for_state(self) -> dict[str, Any]:
        """The totals under their ``DatasetState`` names, dollars in USD."""
        out: dict[str, Any] = {}
        for f in fields(self):
            name = f.metadata["state"]
            if name is None:
                continue
            value = getattr(self, f.name)
            if f.name.endswith("_nusd"):
                name, value = name or f.name.removesuffix("_nusd") + "_usd", value / NUSD_PER_USD
            out[name or f.name] = value
        return out


def _read(source: str) -> list[tuple[str, str, bool]]:
    """(attribute, hash field, is a string) of the snapshot's attributes read from ``source``."""
    return [(f.name, f.metadata["field"], f.type == "str") for f in fields(BudgetSnapshot)
            if f.metadata["hash"] == source]


_DATASET_READS = _read("budget")
_RUN_READS = _read("run")
_LEASE_READS = _read("leases")
#: Commands ``queue_snapshot`` adds to a pipeline.
SNAPSHOT_COMMANDS = 3


def queue_snapshot(pipe: Any, dataset: str) -> None:
    """Adds the reads of a snapshot to ``pipe`` (``SNAPSHOT_COMMANDS`` replies, for ``parse_snapshot``),
    so a caller can read the budget in the same round trip as its other keys."""
    k = DatasetKeys(dataset)
    pipe.hmget(k.budget, *(hash_field for _, hash_field, _ in _DATASET_READS))
    pipe.hlen(k.leases)
    pipe.hmget(RUN_BUDGET, *(hash_field for _, hash_field, _ in _RUN_READS))


def _decode(v: Any, text: bool) -> Any:
    if text:
        return (v or b"").decode() if isinstance(v, bytes | None) else str(v)
    return int(v or 0)


def parse_snapshot(replies: Sequence[Any]) -> BudgetSnapshot:
    budget, in_flight, run = replies[:SNAPSHOT_COMMANDS]
    values: dict[str, Any] = {}
    for reads, reply in ((_DATASET_READS, budget), (_RUN_READS, run)):
        values.update({name: _decode(v, text) for (name, _, text), v in zip(reads, reply, strict=True)})
    values.update({name: _decode(in_flight, text) for name, _, text in _LEASE_READS})
    return BudgetSnapshot(**values)


def open_run(client: redis.Redis, limit_usd: float | None, datasets: Sequence[str]) -> float:
    """Start or resume the run's dollar count: re-summed from its datasets' counters (so a resumed
    run continues, and another config's spending is not carried in). Returns dollars spent so far."""
    script = client.register_script(_SCRIPT)
    reply = script(keys=[RUN_BUDGET, *(DatasetKeys(d).budget for d in datasets)],
                   args=["run_open", to_nusd(limit_usd) if limit_usd else 0])
    return int(reply[1]) / NUSD_PER_USD


def _counts(usage: Usage | None) -> str:
    """A billed answer's stats increments as the script takes them: a JSON object, "" for none."""
    return "" if usage is None else json.dumps(answer_counts(usage), separators=(",", ":"))


#: One registered script per client: a worker builds a Budget per task, and registering hashes
#: the whole script (2% of a busy worker).
_SCRIPTS: weakref.WeakKeyDictionary[redis.Redis, Any] = weakref.WeakKeyDictionary()


def _script_of(client: redis.Redis) -> Any:
    script = _SCRIPTS.get(client)
    if script is None:
        script = _SCRIPTS[client] = client.register_script(_SCRIPT)
    return script


class Committer(Protocol):
    """Sends script calls of many callers behind one AOF fence (``workers/fleet/group_commit.py``)."""

    def call(self, script: Any, keys: Sequence[str], args: Sequence[Any],
             before: Callable[[Any], None] | None = None) -> Any: ...


#: Clients whose budget calls go through a group commit (a gevent worker's): see ``group_commit``.
_COMMITTERS: weakref.WeakKeyDictionary[redis.Redis, Committer] = weakref.WeakKeyDictionary()


def group_commit(client: redis.Redis, committer: Committer) -> None:
    """Every later ``Budget`` on ``client`` calls the script through ``committer``: the same
    replies, each only once its writes are in the AOF, with one round trip and one fence per batch."""
    _COMMITTERS[client] = committer


class Budget:
    def __init__(self, client: redis.Redis, dataset: str, policy: BudgetPolicy = POLICY) -> None:
        self.keys = DatasetKeys(dataset)
        self.policy = policy
        self._client = client
        self._script = _script_of(client)
        self._committer = _COMMITTERS.get(client)

    def _call(self, *args: Any, answered: bool = False) -> list[Any]:
        """Run the script and wait until its writes are in the AOF (WAITAOF), on one connection.

        An answer the caller acts on (a request admitted, a row counted) must survive the Redis
        host crashing a moment later: with ``appendfsync everysec`` the last second of writes can
        be lost (a killed process loses nothing it acknowledged; a lost machine does), and a lease
        or a settle lost that way makes a prompt asked twice. Both commands travel in
        one pipeline, so when the connection breaks the retry runs both again on the restarted
        server (every operation is safe to repeat). Without AOF the fence answers an error and the
        reply stands as it is.

        ``answered``: the call carries a billed answer (its usage counters are in ``args``, for the
        script to add once per lease): the fleet's misconfiguration streak is cleared in the same
        round trip (``common/stats.py``).

        On a client registered with ``group_commit`` (a worker's), the call shares its pipeline and
        its fence with the other greenlets' calls of the moment, with the same guarantees.
        """
        script = self._script
        if self._committer is not None:
            reply = self._committer.call(script, self.keys.budget_keys, args, queue_answered if answered else None)
            return [x.decode() if isinstance(x, bytes) else x for x in reply]
        for _ in range(3):
            pipe = self._client.pipeline(transaction=False)
            if answered:
                queue_answered(pipe)
                answered = False
            pipe.evalsha(script.sha, len(self.keys.budget_keys), *self.keys.budget_keys, *args)
            pipe.execute_command(*fence_command(pipe))
            *_, reply, fence = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # a restarted server: load the script again
                script.sha = self._client.script_load(script.script)
                continue
            if isinstance(reply, Exception):
                raise reply
            if fence_failed(fence):
                raise fence
            return [x.decode() if isinstance(x, bytes) else x for x in reply]
        raise ResponseError("budget.lua: the server keeps forgetting the script")

    # --- workers ---------------------------------------------------------------------------

    def reserve(self, prompt_id: str, lease: str, *, ttl_ms: int, ask: Ask, batch_round: bool = False) -> Admission:
        """Admit a request (``batch_round``: one of a Batch API round, held on the round's
        statistical bound once enough rows are kept, budget.lua's rule)."""
        z = self.policy.batch_hold_z if batch_round else 0
        reply = self._call("reserve", prompt_id, lease, now_ms(), ttl_ms, ask.worst_tokens, ask.worst_nusd,
                           ask.prior_tokens, self.policy.prior_weight_rows, self.policy.trust_rows, z,
                           self.policy.batch_hold_rows)
        return Admission(reply_outcome("reserve", reply[0]), int(reply[1]) if len(reply) > 1 else 0)

    def round_hold(self, worst_tokens: int) -> int:
        """The tokens a batch round's next request would hold now. Read only, so not fenced: the
        producer asks it on every tick, and a WAITAOF there would only wait for the disk."""
        reply = self._script(keys=self.keys.budget_keys,
                             args=["round_hold", worst_tokens, self.policy.batch_hold_z, self.policy.batch_hold_rows])
        return int(reply[0])

    def renew(self, prompt_id: str, lease: str, *, ttl_ms: int) -> Outcome:
        """Extend an admitted request's lease before a retry; takes no new budget. One of
        ``REPLIES["renew"]``: lost when the lease was reaped meanwhile."""
        return reply_outcome("renew", self._call("renew", prompt_id, lease, now_ms(), ttl_ms)[0])

    def queue_renew(self, pipe: Any, prompt_id: str, lease: str, *, ttl_ms: int) -> None:
        """Adds ``renew`` to ``pipe`` (a MULTI with other writes: the batch path's intent record and the
        leases its batch will live on are made together, workers/pipeline/batch/records.py). Its reply is
        ``[renewal]``; the script must be loaded (a reserve on this client loaded it)."""
        pipe.evalsha(self._script.sha, len(self.keys.budget_keys), *self.keys.budget_keys, "renew", prompt_id,
                     lease, now_ms(), ttl_ms)

    def settle(self, prompt_id: str, lease: str, tokens: int, row: bytes, *, cost_usd: float,
               attempts: int = 0, turn: TurnKeep | None = None, usage: Usage | None = None) -> Outcome:
        """Count a billed answer's cost, and keep its row (hand it to the collector): kept, unless
        another delivery already did (duplicate) or the hard cap has no room for it (discarded).

        ``turn`` (regenerate = "all"; ``prompt_id`` is then the row key): kept with the row, atomically.
        ``usage``: the answer's counters for the dataset's stats, added with it.

        Safe to repeat: the same settle (this lease's) executed again, because its reply was lost
        (a spool replay, a resent pipeline), answers what the first execution answered and adds
        nothing (budget.lua's ``settled`` markers); so do ``fail`` and ``release``."""
        extra: tuple[Any, ...] = ()
        if turn is not None:
            extra = (turn.record, turn.conversation, "1" if turn.ends else "0")
        reply = self._call("settle", prompt_id, lease, tokens, to_nusd(cost_usd), attempts, row, _counts(usage),
                           *extra, answered=usage is not None)
        if int(reply[-1]):
            # The dollar cap holds only while answers cost no more than their worst case.
            log.warning("%s/%s: the answer cost $%.6f, more than its worst case: is the model's price right?",
                        self.keys.dataset, prompt_id, cost_usd)
        return reply_outcome("settle", reply[0])

    def fail(self, prompt_id: str, lease: str, reason: str, attempts: int, detail: str, *,
             where: str = "", cost_usd: float = 0.0, usage: Usage | None = None) -> Outcome:
        """Record the prompt's failure (a ``failed.jsonl`` line; ``where`` is its ``file:line``):
        failed, or duplicate when another delivery kept the prompt meanwhile; ``cost_usd`` of an
        answer that was billed before it failed still counts."""
        failure = json.dumps({"reason": reason, "attempts": attempts, "detail": detail[:500], "where": where})
        reply = self._call("fail", prompt_id, lease, failure, to_nusd(cost_usd), _counts(usage),
                           answered=usage is not None)
        return reply_outcome("fail", reply[0])

    def release(self, prompt_id: str, lease: str, *, cost_usd: float = 0.0, usage: Usage | None = None) -> None:
        """Give an admission back without an outcome; a billed answer's cost and ``usage`` still count."""
        reply = self._call("release", prompt_id, lease, to_nusd(cost_usd), _counts(usage), answered=usage is not None)
        reply_outcome("release", reply[0])

    def halt(self, reason: str, message: str, worker: str) -> None:
        """Stop every admission of every dataset: the account itself was refused."""
        record = {"reason": reason, "message": message[:HALT_MESSAGE_MAX_CHARS], "worker": worker}
        self._client.set(HALT, json.dumps(record), nx=True)

    # --- producer --------------------------------------------------------------------------

    def open(self, limit_tokens: int, limit_usd: float | None = None, mode: Mode = "hard") -> tuple[int, int]:
        """Start or resume the dataset; returns (kept tokens, rows) so far."""
        reply = self._call("open", limit_tokens, to_nusd(limit_usd) if limit_usd else 0, mode)
        return int(reply[1]), int(reply[2])

    def close(self) -> None:
        self._call("close")

    def reap(self) -> int:
        """Expired leases (dead or stalled workers): tokens go back, dollars stay held as orphans."""
        return int(self._call("reap", now_ms())[1])

    def agrees_with(self, last_id: str, rows: int, manifests: Collection[str] = ()) -> bool:
        """Whether the done set and the kept counters already count exactly ``rows`` rows on disk
        (up to stream position ``last_id``) plus those waiting in the results stream after it, each
        made under one of ``manifests`` (empty: any)."""
        reply = self._call("reconcile", last_id, rows, 0, 0, 0, "check", ",".join(manifests))
        return bool(reply[0] == "current")

    def reconcile(self, last_id: str, ids: Sequence[str], tokens: Sequence[int], costs_usd: Sequence[float],
                  manifests: Collection[str] = ()) -> tuple[int, int, int] | None:
        """Make the done set and the kept counters the rows on disk (``ids`` with their tokens and
        costs, up to ``last_id``) plus those waiting in the results stream, made under one of
        ``manifests`` (empty: any; another run's rows, of another config, are deleted): an id done
        whose row is in neither is asked again; ids Redis lost are done again, the dollars spent at
        least their cost. (rows, lost, rows deleted) when it changed anything, else None."""
        reply = self._call("reconcile", last_id, len(ids), sum(tokens), sum(t * t for t in tokens),
                           sum(to_nusd(c) for c in costs_usd), "apply", ",".join(manifests), *ids)
        return (int(reply[1]), int(reply[2]), int(reply[3])) if reply[0] == "reconciled" else None

    def drop_rows(self, rows: Sequence[tuple[str, str, int]]) -> int:
        """Delete rows waiting in the results stream (``(stream id, prompt id, tokens)``) and count
        them no longer kept, so their prompts are asked again; returns how many were."""
        if not rows:
            return 0
        return int(self._call("drop_rows", *(x for row in rows for x in row))[1])

    def snapshot(self) -> BudgetSnapshot:
        pipe = self._client.pipeline(transaction=False)
        queue_snapshot(pipe, self.keys.dataset)
        return parse_snapshot(pipe.execute())

    def failures(self) -> dict[str, dict[str, Any]]:
        raw = self._client.hgetall(self.keys.failed)
        return {k.decode(): json.loads(v) for k, v in raw.items()}
