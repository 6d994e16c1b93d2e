"""Python face of ``budget.lua``: one method per operation, typed answers.

Both sides use it: workers reserve/settle/fail/release, the producer opens, reaps and closes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

import redis

from common.keys import HALT, DatasetKeys

_SCRIPT = files("common").joinpath("budget.lua").read_text(encoding="utf-8")

#: How many kept rows the prior estimate weighs as; after a few times this many rows the estimate
#: is the measured mean.
PRIOR_WEIGHT_ROWS = 2
#: Kept rows after which the estimate is trusted to declare the budget fully committed; before,
#: a full budget makes requests wait for in-flight ones to land instead of ending the dataset.
TRUST_ROWS = 20

Admission = Literal["ok", "done", "stopped", "busy", "over", "wait", "halted"]


@dataclass(frozen=True)
class Reservation:
    status: Admission
    #: Tokens reserved (ok/over) or ms until a busy lease expires (busy); 0 otherwise.
    value: int


@dataclass(frozen=True)
class BudgetSnapshot:
    limit: int
    kept: int
    reserved: int
    rows: int
    state: str  # active | exhausted | stopped | "" (never opened)
    in_flight: int


def now_ms() -> int:
    return int(time.time() * 1000)


class Budget:
    def __init__(self, client: redis.Redis, dataset: str) -> None:
        self.keys = DatasetKeys(dataset)
        self._client = client
        self._script = client.register_script(_SCRIPT)

    def _call(self, *args: Any) -> list[Any]:
        reply = self._script(keys=self.keys.budget_keys, args=list(args))
        return [x.decode() if isinstance(x, bytes) else x for x in reply]

    # --- workers ---------------------------------------------------------------------------

    def reserve(self, prompt_id: str, lease: str, *, ttl_ms: int, prior_estimate: int) -> Reservation:
        reply = self._call(
            "reserve", prompt_id, lease, now_ms(), ttl_ms, prior_estimate, PRIOR_WEIGHT_ROWS, TRUST_ROWS
        )
        return Reservation(reply[0], int(reply[1]) if len(reply) > 1 else 0)

    def settle(self, prompt_id: str, lease: str, tokens: int, row: bytes) -> bool:
        """Count a kept row and hand it to the collector. False: another delivery already did."""
        return self._call("settle", prompt_id, lease, tokens, row)[0] == "kept"

    def fail(self, prompt_id: str, lease: str, reason: str, attempts: int, detail: str, *, where: str = "") -> bool:
        """Record the prompt's failure (a ``failed.jsonl`` line); ``where`` is its ``file:line``."""
        failure = json.dumps({"reason": reason, "attempts": attempts, "detail": detail[:500], "where": where})
        return self._call("fail", prompt_id, lease, failure)[0] == "failed"

    def release(self, prompt_id: str, lease: str) -> None:
        self._call("release", prompt_id, lease)

    def halt(self, reason: str, message: str, worker: str) -> None:
        """Stop every admission of every dataset: the account itself was refused."""
        self._client.set(HALT, json.dumps({"reason": reason, "message": message[:300], "worker": worker}), nx=True)

    # --- producer --------------------------------------------------------------------------

    def open(self, limit_tokens: int) -> tuple[int, int]:
        """Start or resume the dataset under ``limit_tokens``; returns (kept tokens, rows) so far."""
        reply = self._call("open", limit_tokens)
        return int(reply[1]), int(reply[2])

    def close(self) -> None:
        self._call("close")

    def reap(self) -> int:
        return int(self._call("reap", now_ms())[1])

    def snapshot(self) -> BudgetSnapshot:
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(self.keys.budget, "limit", "kept", "reserved", "rows", "state")
        pipe.hlen(self.keys.leases)
        (limit, kept, reserved, rows, state), in_flight = pipe.execute()
        return BudgetSnapshot(
            limit=int(limit or 0),
            kept=int(kept or 0),
            reserved=int(reserved or 0),
            rows=int(rows or 0),
            state=(state or b"").decode(),
            in_flight=int(in_flight),
        )

    def failures(self) -> dict[str, dict[str, Any]]:
        raw = self._client.hgetall(self.keys.failed)
        return {k.decode(): json.loads(v) for k, v in raw.items()}
