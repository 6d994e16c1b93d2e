"""A paid answer is never dropped: settle (or fail) while Redis is away, else keep it on local disk.

``settle_or_spool`` / ``fail_or_spool`` retry while the prompt's lease lives (Redis restarting in a
few seconds costs nothing); if Redis is still away when the lease would end, the outcome goes to
the spool: one file per prompt under ``SPECFLEET_SPOOL_DIR``, written atomically (tmp + fsync +
rename). Every worker replays the spool on start and every few seconds while it runs
(workers/fleet/recovery.py), through the same ``budget.lua`` operations, which count once per lease: a
settle replayed after its first execution landed after all (Redis frozen: the read timed out, the
buffered command ran later), or replayed twice, answers what it first answered and adds no dollar,
request or token again; after another delivery kept the prompt it is a ``duplicate`` (the done
set), billed and counted, its row dropped. Workers on one host may share the folder; replaying a
file twice is harmless for the same reason.
Fleets on one host that use different Redis servers may share it too: an entry names its run
config, and is replayed only into a Redis that holds that run (a dataset's prompt ids alone would
collide between two runs of the same file, and one fleet would take the other's answers).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgpack

from common import keys
from common.budget import Budget, TurnKeep
from common.contract import Usage
from common.files import atomic_write
from common.outcomes import Outcome
from common.redis_client import REFUSED_WRITES, UNREACHABLE, deadline
from common.stats import DatasetStats
from workers.fleet import send_room, writes

log = logging.getLogger(__name__)

SUFFIX = ".spool"


def _path(spool_dir: Path, run: str, dataset: str, prompt_id: str, kind: str) -> Path:
    digest = hashlib.sha256(f"{run}\0{dataset}\0{prompt_id}".encode()).hexdigest()[:32]
    return spool_dir / f"{kind}-{digest}{SUFFIX}"


def write_entry(spool_dir: Path, entry: dict[str, Any]) -> Path:
    spool_dir.mkdir(parents=True, exist_ok=True)
    path = _path(spool_dir, entry.get("run", ""), entry["dataset"], entry["id"], entry["op"])
    # Workers sharing the folder may spool the same prompt at once: each its own temporary file,
    # hidden from ``pending`` (a dot, no SUFFIX).
    atomic_write(path, msgpack.packb(entry, use_bin_type=True), tmp=path.with_name(f".{path.name}.{os.getpid()}.tmp"))
    return path


def _divert(spool_dir: Path, entry: dict[str, Any], reason: str) -> None:
    path = write_entry(spool_dir, entry)
    log.warning("%s/%s %s: %s: spooled to %s", entry["dataset"], entry["id"], entry["op"], reason, path)


def _apply(client: Any, entry: dict[str, Any]) -> Outcome:
    """The budget's answer to the entry: kept | duplicate | discarded (settle), failed | duplicate
    (fail). The billed cost travels with it, so a replay counts the dollars too."""
    budget = Budget(client, entry["dataset"])
    cost_usd = float(entry.get("cost_usd", 0.0))
    if entry["op"] == "settle":
        turn = entry.get("turn")
        return budget.settle(entry["id"], entry["lease"], int(entry["tokens"]), entry["row"], cost_usd=cost_usd,
                             attempts=int(entry.get("attempts", 0)),
                             turn=None if turn is None else TurnKeep(turn[0], turn[1], bool(turn[2])),
                             usage=entry.get("usage"))
    return budget.fail(entry["id"], entry["lease"], entry["reason"], int(entry["attempts"]), entry["detail"],
                       where=entry.get("where", ""), cost_usd=cost_usd, usage=entry.get("usage"))


#: Set once the worker is stopping (workers/fleet/stop.py): an unreachable Redis is waited for this long
#: at most, not the lease's slack. And why every outcome goes to the spool at once (None: it does
#: not): the Redis at the URL is not the one the worker served (workers/fleet/server.py).
_hurry_s: float | None = None
_diverted: str | None = None


#: Outcomes being written now, by ``id(entry)``, and those of them already on disk (``spill``).
_open: dict[int, tuple[Path, dict[str, Any]]] = {}
_spilled: set[int] = set()


def unspooled() -> int:
    """Outcomes being written that are not on disk yet (a stopping worker waits for these only)."""
    return sum(1 for key in _open if key not in _spilled)


def spill(reason: str) -> int:
    """Every outcome from now on goes to the spool at once (``divert``), and every one being written
    now is written there too, while its own attempt goes on: with Redis unreachable at a stop, a
    settle that began before it would otherwise wait its lease, or a free connection, past the
    stop's bound, and the answer was left. Should that attempt land after all, its file is removed;
    replayed anyway, it answers what it first answered and counts nothing twice. Returns how many."""
    divert(reason)
    spilled = 0
    for key, (spool_dir, entry) in list(_open.items()):
        if key in _spilled:
            continue
        _divert(spool_dir, entry, reason)
        _spilled.add(key)
        spilled += 1
    return spilled


def hurry(within_s: float) -> None:
    global _hurry_s
    _hurry_s = within_s


def divert(reason: str) -> None:
    global _diverted
    _diverted = reason


def _or_spool(client: Any, spool_dir: Path, entry: dict[str, Any], within_s: float) -> Outcome:
    """The budget's answer; spooled: Redis stayed away for ``within_s``."""
    key = id(entry)
    _open[key] = (spool_dir, entry)
    send_room.process_room().handed()  # this task's paid answer is the spool's to keep now
    outcome = Outcome.SPOOLED
    try:
        outcome = _settle_or_spool(client, spool_dir, entry, within_s)
        return outcome
    finally:
        del _open[key]
        if key in _spilled:
            _spilled.discard(key)
            if outcome is not Outcome.SPOOLED:  # it landed after ``spill`` wrote it: nothing left to replay
                with contextlib.suppress(FileNotFoundError):
                    _path(spool_dir, entry.get("run", ""), entry["dataset"], entry["id"], entry["op"]).unlink()


def _settle_or_spool(client: Any, spool_dir: Path, entry: dict[str, Any], within_s: float) -> Outcome:
    if _diverted is not None:
        _divert(spool_dir, entry, _diverted)
        return Outcome.SPOOLED
    if _hurry_s is not None:
        within_s = min(within_s, _hurry_s)
    try:
        with deadline(within_s):
            return _apply(client, entry)
    except UNREACHABLE as exc:
        path = write_entry(spool_dir, entry)
        log.warning("%s/%s %s: Redis unreachable for %.0f s (%s): spooled to %s", entry["dataset"], entry["id"],
                    entry["op"], within_s, exc, path)
        return Outcome.SPOOLED
    except REFUSED_WRITES as exc:  # a state (workers/fleet/writes.py): replayed once Redis takes writes
        writes.refused(exc)
        path = write_entry(spool_dir, entry)
        log.warning("%s/%s %s: Redis refused its write: spooled to %s", entry["dataset"], entry["id"], entry["op"],
                    path)
        return Outcome.SPOOLED


def settle_or_spool(client: Any, spool_dir: Path, run: str, budget: Budget, prompt_id: str, lease: str,
                    tokens: int, row: bytes, *, cost_usd: float, attempts: int, within_s: float,
                    turn: TurnKeep | None = None, usage: Usage | None = None) -> Outcome:
    """``run``: the run-config id of the task; ``usage``: the answer's counters
    (``common/stats.py``), counted with the settle, spooled with it."""
    entry: dict[str, Any] = {"op": "settle", "run": run, "dataset": budget.keys.dataset, "id": prompt_id,
                             "lease": lease,
                             "tokens": tokens, "row": row, "cost_usd": cost_usd, "attempts": attempts,
                             "usage": usage, "t_s": time.time()}
    if turn is not None:  # a conversation's turn travels with its row, so a replay stores it too
        entry["turn"] = [turn.conversation, turn.record, turn.ends]
    return _or_spool(client, spool_dir, entry, within_s)


def fail_or_spool(client: Any, spool_dir: Path, run: str, budget: Budget, prompt_id: str, lease: str,
                  reason: str, attempts: int, detail: str, *, where: str, cost_usd: float, within_s: float,
                  usage: Usage | None = None) -> Outcome:
    entry = {"op": "fail", "run": run, "dataset": budget.keys.dataset, "id": prompt_id, "lease": lease,
             "reason": reason, "attempts": attempts, "detail": detail, "where": where, "cost_usd": cost_usd,
             "usage": usage, "t_s": time.time()}
    return _or_spool(client, spool_dir, entry, within_s)


def pending(spool_dir: Path) -> list[Path]:
    try:
        return sorted(spool_dir.glob(f"*{SUFFIX}"))
    except OSError:
        return []


#: Entries of runs this Redis does not hold, already reported (one warning each, not one per replay).
_FOREIGN: set[Path] = set()


def _ours(client: Any, entry: dict[str, Any], path: Path) -> bool:
    """Whether the entry's run lives in this Redis (an entry of an older version names none)."""
    run = entry.get("run")
    if not run or client.exists(keys.config(run)):
        return True
    if path not in _FOREIGN:
        _FOREIGN.add(path)
        log.warning("spool: %s belongs to run %s, which this Redis does not hold: left for a worker of its own "
                    "Redis", path, run)
    return False


def replay(client: Any, spool_dir: Path, *, within_s: float = 2.0) -> int:
    """Settle (or fail) every spooled outcome; stops at the first sign Redis is still away.
    Returns how many entries were replayed.

    Each file is replayed under an exclusive ``flock``: the timer's replay and one at a consumer
    restart, or two workers sharing the folder, would otherwise apply one entry twice (harmless for
    the budget and the usage counters, which count once per lease, but a failed entry's
    ``fail:<reason>`` counter, counted here, would count twice). The lock dies with its process, so a
    replayer killed midway leaves the file to the next."""
    done = 0
    for path in pending(spool_dir):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # another replayer took it meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # being replayed right now
                continue
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    continue
            except FileNotFoundError:  # replayed and removed while we waited for the lock
                continue
            outcome = _replay_one(client, path, fd, within_s)
        finally:
            os.close(fd)
        if outcome is None:
            return done
        done += outcome
    return done


def _replay_one(client: Any, path: Path, fd: int, within_s: float) -> int | None:
    """1 when the entry was applied and removed, 0 when it stays (unreadable, another Redis's run),
    None when Redis is still away."""
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            entry = msgpack.unpackb(fh.read(), raw=False)
    except (ValueError, msgpack.UnpackException) as exc:  # a torn file cannot come from write_entry
        log.error("spool: unreadable %s (%s): left in place", path, exc)
        return 0
    try:
        with deadline(within_s):
            if not _ours(client, entry, path):
                return 0
            answer = _apply(client, entry)
    except UNREACHABLE:
        return None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    # Counted by whoever saw the answer: the worker that spooled the entry saw none, and a repeat of
    # an entry that landed answers the same word, so each failure counts once.
    if answer is Outcome.FAILED or answer is Outcome.DISCARDED:
        reason = entry["reason"] if answer is Outcome.FAILED else "over_budget"
        with contextlib.suppress(*UNREACHABLE):
            DatasetStats(client, entry["dataset"]).record_failure(reason)
    log.info("%s/%s %s replayed from the spool: %s", entry["dataset"], entry["id"], entry["op"], answer)
    return 1
