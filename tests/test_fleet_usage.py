"""End to end, real processes: a run whose tokenizer is not the served model's halts within its first
answers (their billed usage disagrees with the rows' ids, common/usage_check.py), and the same run
with the right tokenizer completes with no row flagged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from common.contract import HALT_USAGE
from tests.fleet import DEMO_TOKENIZER, Fleet, read_summary

pytestmark = pytest.mark.fleet

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

N_PROMPTS = 300
CONCURRENCY = 10
#: Merges the converted tokenizer lacks: the demo tokenizer's 40 most common (a converter that drops
#: a pre-tokenizer rule, or another revision of the vocabulary, tokenizes some words otherwise).
DROPPED_MERGES = 40


def _converted_tokenizer(folder: Path) -> Path:
    """The demo tokenizer's files with its first merges removed: same chat template, same specials,
    another tokenization of ordinary text."""
    folder.mkdir()
    for f in DEMO_TOKENIZER.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][DROPPED_MERGES:]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def _rows(out: Path, dataset: str) -> list[dict[str, object]]:
    return [json.loads(line) for f in sorted((out / dataset).glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_a_wrong_tokenizer_halts_the_run_in_its_first_answers_and_the_right_one_flags_nothing(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")  # bills with the demo tokenizer, as its engine
    fleet.start_worker("w1", concurrency=CONCURRENCY)
    wrong = fleet.one_dataset("T", N_PROMPTS, tokenizer=_converted_tokenizer(fleet.tmp / "converted"))

    producer = fleet.start_producer(wrong, "producer1", "--no-plan")
    assert producer.wait(timeout=120) == 3, fleet.all_logs()
    halted = [ln for ln in fleet.log("producer1").splitlines() if ln.startswith("specfleet: halted:")]
    assert len(halted) == 1, fleet.log("producer1")
    # The 11th disagreeing answer (5% of 200) halts; answers in flight then that disagree too halt
    # again (nothing of them is kept) and the last one's count is the line's.
    over = re.search(r"(\d+) of the first 200 answers", halted[0])
    assert over and 11 <= int(over[1]) <= 11 + CONCURRENCY and "[model] tokenizer" in halted[0], halted[0]
    assert json.loads(redis_client.get("specfleet:halt") or "{}")["reason"] == HALT_USAGE
    # Halted at the 11th disagreeing answer (5% of 200): what was in flight then lands, nothing more
    # is sent; every kept row says it disagreed.
    requests = fleet.sim_stats()["requests"]
    assert 11 <= requests <= 11 + 2 * CONCURRENCY, requests
    # The first answer sets the learned offset; ten disagreeing ones are kept, flagged; the 11th halts.
    kept = _rows(fleet.out, "T")
    flagged = [r for r in kept if r["usage_check"]["match"] is False]  # type: ignore[index]
    assert len(flagged) == 10 and len(kept) <= 10 + CONCURRENCY, [r["usage_check"] for r in kept]  # type: ignore[index]
    assert "billed - counted" in halted[0] and "(t.jsonl:" in halted[0]

    # The right tokenizer, the same prompts: every answer agrees, the end token and all.
    right = fleet.one_dataset("R", N_PROMPTS)
    fleet.run_producer(right, name="producer2")
    fleet.assert_exactly_once(redis_client, "R", N_PROMPTS)
    assert [r["usage_check"] for r in _rows(fleet.out, "R")] == [
        {"match": True, "prompt_diff": 0, "completion_diff": 0}] * N_PROMPTS
    summary = read_summary(fleet.out, "R")
    assert (summary["usage_checked"], summary["usage_mismatch"], summary["usage_warning"]) == (N_PROMPTS, 0, None)
