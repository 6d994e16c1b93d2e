"""Every Redis key specfleet writes, in one place, under one prefix.

Layout (``<ds>`` is a dataset name, ``<cid>`` a run-config id):

    specfleet:config:<cid>          STRING  run config as JSON (secrets stripped), written by the producer
    specfleet:usage:<cid>:<mid>     HASH    the usage check of a run config under one manifest (<mid>: its id, which
                                            hashes the tokenizer files: fixed ones learn afresh; usage_check.lua):
                                            answers checked, the billed-minus-counted differences of the first ones, the
                                            learned offset and the mismatches that halt the run; expires 30 days after
                                            its last answer
    specfleet:active                HASH    queue name -> run-config id: what workers consume now (they poll it)
    specfleet:ds:<ds>:budget        HASH    the dataset's budget counters (fields: see budget.lua)
    specfleet:ds:<ds>:done          SET     prompt ids whose row was kept (the exactly-once guard)
    specfleet:ds:<ds>:seal_key      STRING  the dataset's seal key (32 random bytes, hex; SET NX, kept across runs):
                                            a worker runs only a message whose payload carries the HMAC of its id
                                            under it (common/seal.py, workers/fleet/poison.py)
    specfleet:ds:<ds>:leases        HASH    prompt id -> "<lease>|<hold tokens>|<hold nano-usd>|<expires_ms>"
    specfleet:ds:<ds>:orphans       HASH    lease -> nano-usd still held for a reaped lease (it may be billed)
    specfleet:ds:<ds>:failed        HASH    prompt id -> JSON {reason, attempts, detail, where} (cleared if kept later)
    specfleet:ds:<ds>:settled       HASH    "<lease>:<prompt id>" -> "<answer>|<over_hold>": that lease's settle, fail
                                            or release of the prompt was applied (budget.lua): a repeat of it (a lost
                                            reply: a spool replay, a resent pipeline) answers the same and counts
                                            nothing again. Expires 7 days after the dataset's last outcome
    specfleet:ds:<ds>:turns         HASH    regenerate = "all": row key "<id>#<turn>" -> msgpack {message, end}: a
                                            kept turn's regenerated assistant message, written by budget.lua's
                                            settle with the row, read back when a conversation is delivered again
    specfleet:ds:<ds>:ended         SET     regenerate = "all": conversation ids that ended with a kept turn (the
                                            last one, or one that called tools): their outcome, as ``done`` is a
                                            prompt's (a failed turn's outcome is its ``failed`` entry)
    specfleet:ds:<ds>:results       STREAM  kept rows (field ``row``: msgpack), drained by the collector
    specfleet:ds:<ds>:stats         HASH    counters for reports and metrics (billed tokens, errors by class…; field
                                            names: common/stats.py); a billed answer's usage is added by budget.lua
                                            with its settle, fail or release, once per lease
    specfleet:ds:<ds>:timeline      LIST    JSON samples of progress over time, for the run report's plot
    specfleet:producer:lock         STRING  one producer per Redis at a time: "<generation>|<host>:<pid>", expires 10 s
                                            after its last refresh (producer/lock.py)
    specfleet:producer:generation   STRING  the token of the last producer that took the lock (no expiry): its
                                            generation fences every older producer's writes
    specfleet:run:current           STRING  JSON {config_id, datasets, started_s, out_dir} of the run in progress
    specfleet:collector:fence       STRING  a counter the collector bumps so WAITAOF covers the rows it read
    specfleet:run:budget            HASH    the run's dollars across all its datasets (spent, held, limit; see
                                            budget.lua): one counter so a run-wide cap is atomic
    specfleet:halt                  STRING  JSON {reason, message, worker}: the account was refused (401, 402)
                                            or the URL/model is wrong: every admission stops until the next
                                            `specfleet run` (contract.halt_line says it to the user)
    specfleet:misconfig             SET     prompt ids that met a "wrong URL or model" answer since the last
                                            answer anywhere (common/stats.py; workers/pipeline/retry.py halts on it)
    specfleet:throttle              HASH    the fleet-wide adaptive in-flight limit, pause, rate bucket (throttle.lua)
    specfleet:throttle:slots        ZSET    upstream requests in flight, fleet-wide: slot id -> expiry ms
    specfleet:deadletter            LIST    messages a worker refused to run (workers/fleet/poison.py), newest
                                            first, the last DEAD_LETTER_MAX: JSON {reason, detail, queue,
                                            received_at, worker, bytes, truncated, raw_b64 (the first
                                            DEAD_LETTER_RAW_BYTES, secrets scrubbed)}
    specfleet:deadletter:counts     HASH    queue -> messages refused from it, in all runs (summary, status)
    specfleet:writes:probe          STRING  a worker's test write while Redis refuses writes (workers/fleet/writes.py);
                                            expires in seconds
    specfleet:batches:open          ZSET    batch intents not yet settled: intent id -> created ms (common/batches.py)
    specfleet:batch:<intent>        HASH    one batch's record: run, dataset, model, created_s, state (posting |
                                            submitted | done), batch_id (OpenRouter's, once known), counts, costs;
                                            written before the POST (the intent), so a crash cannot bill twice
    specfleet:batch:<intent>:requests HASH  custom_id -> msgpack {payload, lease}: what the batch asked, for the
                                            settle of its results (by any worker)
    specfleet:batch:<intent>:handled SET    custom_ids whose result (or absence) was settled: a poller taking over
                                            goes on where the last one stopped
    specfleet:batch:<intent>:poller STRING  the worker polling the batch now (SET NX PX): one at a time, and the
                                            next poll once it expires
    specfleet:batch:claims          HASH    OpenRouter batch id -> intent id: a batch found by recovery is taken once
    specfleet:ds:<ds>:batched       HASH    prompt id -> intent id: the prompt waits in a submitted batch (a
                                            redelivery of its message is acked, not asked again)
    specfleet:tokenizer:<hash>      HASH    file name -> bytes: a run's tokenizer files, put by the producer when the
                                            run starts (content-addressed by the files' hashes, common/tokenizer_pin.py)
                                            and read by workers into their local cache. Expires 7 days after the
                                            start of the last run that put it; a run of the same files puts it again
    specfleet:store                 STRING  this store's random id, written once (SET NX) by the first worker to
                                            find none: a worker that meets another id leaves (workers/fleet/server.py)

Celery's own keys (the queue lists ``specfleet.q.<ds>``, ``unacked``, ``_kombu.*``) are kombu's.
"""

from __future__ import annotations

PREFIX = "specfleet"

ACTIVE_QUEUES = f"{PREFIX}:active"
PRODUCER_LOCK = f"{PREFIX}:producer:lock"
PRODUCER_GENERATION = f"{PREFIX}:producer:generation"
CURRENT_RUN = f"{PREFIX}:run:current"
HALT = f"{PREFIX}:halt"
COLLECTOR_FENCE = f"{PREFIX}:collector:fence"
MISCONFIG_STREAK = f"{PREFIX}:misconfig"
#: One throttle per Redis: rate limits belong to the account and model, not to a dataset or a run.
THROTTLE = f"{PREFIX}:throttle"
THROTTLE_SLOTS = f"{PREFIX}:throttle:slots"
RUN_BUDGET = f"{PREFIX}:run:budget"
DEAD_LETTERS = f"{PREFIX}:deadletter"
DEAD_LETTER_COUNTS = f"{PREFIX}:deadletter:counts"
#: Entries ``DEAD_LETTERS`` keeps (older ones are trimmed; the counts keep counting), and the bytes
#: of the refused message each keeps: enough to see what it was, never a queue's worth of memory.
DEAD_LETTER_MAX = 1000
DEAD_LETTER_RAW_BYTES = 2048
WRITE_PROBE = f"{PREFIX}:writes:probe"
STORE_ID = f"{PREFIX}:store"
BATCHES_OPEN = f"{PREFIX}:batches:open"
BATCH_CLAIMS = f"{PREFIX}:batch:claims"

#: Prefix of the per-dataset Celery queue name (a Redis list of the same name).
QUEUE_PREFIX = f"{PREFIX}.q."


def config(config_id: str) -> str:
    return f"{PREFIX}:config:{config_id}"


def usage_check(config_id: str, manifest: str) -> str:
    return f"{PREFIX}:usage:{config_id}:{manifest}"


def tokenizer_files(handoff: str) -> str:
    return f"{PREFIX}:tokenizer:{handoff}"


def queue(dataset: str) -> str:
    return f"{QUEUE_PREFIX}{dataset}"


class BatchKeys:
    """The keys of one batch intent (workers/pipeline/batch/records.py)."""

    def __init__(self, intent: str) -> None:
        base = f"{PREFIX}:batch:{intent}"
        self.intent = intent
        self.record = base
        self.requests = f"{base}:requests"
        self.handled = f"{base}:handled"
        self.poller = f"{base}:poller"


class DatasetKeys:
    """The keys of one dataset; ``budget_keys`` is the KEYS order budget.lua expects."""

    def __init__(self, dataset: str) -> None:
        base = f"{PREFIX}:ds:{dataset}"
        self.dataset = dataset
        self.budget = f"{base}:budget"
        self.done = f"{base}:done"
        self.seal_key = f"{base}:seal_key"
        self.leases = f"{base}:leases"
        self.orphans = f"{base}:orphans"
        self.failed = f"{base}:failed"
        self.settled = f"{base}:settled"
        self.results = f"{base}:results"
        self.turns = f"{base}:turns"
        self.ended = f"{base}:ended"
        self.stats = f"{base}:stats"
        self.timeline = f"{base}:timeline"
        self.batched = f"{base}:batched"
        self.queue = queue(dataset)

    @property
    def budget_keys(self) -> list[str]:
        return [self.budget, self.done, self.leases, self.failed, self.results, HALT, RUN_BUDGET, self.orphans,
                self.turns, self.ended, self.stats, self.settled]
