"""Before a dataset asks anything: Redis' exactly-once guard and kept counters made to agree with the
shards on disk (the truth of what is kept), plus the rows waiting in the results stream."""

from __future__ import annotations

import logging
from collections.abc import Collection

import msgpack
import redis

from common import keys
from common.budget import Budget
from producer.refusals import WriteHold
from producer.rows import RowWriter

log = logging.getLogger(__name__)


def restore_from_disk(client: redis.Redis, hold: WriteHold, budget: Budget, writer: RowWriter,
                      regenerate: str, manifests: Collection[str] = ()) -> None:
    """Redis lost kept rows the shards hold (a server without persistence restarted): rebuilt from
    the shards. Redis counts rows the shards lack (written over by a producer that had lost its
    lock, or a folder emptied by hand): those prompts are asked again. Rows waiting in the results
    stream under a manifest not in ``manifests`` (the folder's; empty: any) were made by another
    run of the same dataset name for another folder and config: deleted, their prompts asked again."""
    if hold(lambda: budget.agrees_with(writer.last_id, writer.rows, manifests)):
        return
    rows_in_redis = budget.snapshot().rows
    ids: list[str] = []
    tokens: list[int] = []
    costs: list[float] = []
    turns: dict[str, bytes] = {}
    ended: list[str] = []
    for row in writer.iter_kept():
        ids.append(row.get("key") or row["id"])  # a regenerated turn's key is "<id>#<turn>"
        tokens.append(int(row["num_tokens"]))
        costs.append(float((row.get("usage") or {}).get("cost") or 0.0))
        if regenerate == "all" and "key" in row:
            # The turn as the worker stored it with its settle: the last message of its row.
            end = row.get("conversation_end") or ""
            turns[row["key"]] = msgpack.packb({"message": row["conversations"][-1], "end": end},
                                              use_bin_type=True)
            if end:
                ended.append(row["id"])
    changed = hold(lambda: budget.reconcile(writer.last_id, ids, tokens, costs, manifests))
    if changed is None:
        return
    rows, lost, foreign = changed
    if foreign:
        log.warning("%s: %s rows waiting in Redis were made under a manifest this folder does not hold (another "
                    "run of this dataset name, another config): left out, their prompts asked again",
                    budget.keys.dataset, f"{foreign:,}")
        lost -= foreign
    if lost:
        log.warning("%s: Redis counted %s kept rows the shards do not hold and the results stream does not "
                    "hold either: those prompts are asked again (the shards hold %s rows)", budget.keys.dataset,
                    f"{lost:,}", f"{writer.rows:,}")
    if rows_in_redis < rows:
        log.warning("%s: Redis knew %d kept rows, the shards and the stream hold %d: restoring from the shards "
                    "(dollars from the rows' usage.cost: billed answers that were not kept are not on disk)",
                    budget.keys.dataset, rows_in_redis, rows)
    if turns:
        hold(lambda: restore_turns(client, budget.keys, turns, ended))


def restore_turns(client: redis.Redis, k: keys.DatasetKeys, turns: dict[str, bytes], ended: list[str]) -> None:
    """The conversations' kept turns and ends, rebuilt from the shards with the done set."""
    pipe = client.pipeline(transaction=False)
    items = list(turns.items())
    for i in range(0, len(items), 1000):
        pipe.hset(k.turns, mapping=dict(items[i:i + 1000]))
    for i in range(0, len(ended), 1000):
        pipe.sadd(k.ended, *ended[i:i + 1000])
    pipe.execute()
