"""The hard cap on a real fleet: dollar and token budgets are never exceeded, and end less than one
worst-case answer short; the run's dollar budget ends the run and skips the datasets after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from common.budget import POLICY, Budget, Price
from tests.fleet import Fleet, prompts, read_summary, write_jsonl

pytestmark = pytest.mark.fleet

#: The simulator's default prices (simulator/settings.py), stated in the run file.
SIM_PRICE = Price(prompt=0.60e-6, completion=2.50e-6)
#: Longer than any generated prompt renders to (a few dozen tokens): bounds one worst-case cost.
PROMPT_TOKENS_BOUND = 64


def with_sections(config: Path, text: str, *, max_tokens: int | None = None) -> Path:
    body = config.read_text()
    if max_tokens is not None:
        body = body.replace("max_tokens = 1024", f"max_tokens = {max_tokens}", 1)
    config.write_text(body + "\n" + text)
    return config


PRICING = (f"[model.pricing]\nprompt = {SIM_PRICE.prompt}\ncompletion = {SIM_PRICE.completion}\n"
           "request = 0.0\n")


def test_small_dollar_budgets_are_never_exceeded_and_the_run_budget_skips_what_follows(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "50")
    a = write_jsonl(fleet.tmp / "a.jsonl", prompts(400, "a"))
    b = write_jsonl(fleet.tmp / "b.jsonl", prompts(400, "b"))
    c = write_jsonl(fleet.tmp / "c.jsonl", prompts(50, "c"))
    config = with_sections(fleet.write_config([
        {"name": "A_usd", "path": a, "length": "short", "budget_usd": 0.03},
        {"name": "B_run", "path": b, "length": "short"},
        {"name": "C_after", "path": c, "length": "short"},
    ], run="budget_usd = 0.07"), PRICING)
    fleet.start_worker("w1", concurrency=40)
    fleet.start_worker("w2", concurrency=40)
    out = fleet.run_producer(config)

    worst_usd = POLICY.worst_nusd(SIM_PRICE, PROMPT_TOKENS_BOUND, 1024) / 1e9
    sa, sb, sc = (read_summary(fleet.out, n) for n in ("A_usd", "B_run", "C_after"))
    print(f"A: ${sa['spent_usd']} of $0.03; run: ${sb['run_spent_usd']} of $0.07; worst case ${worst_usd:.5f}")
    assert sa["end_reason"] == "budget_usd"
    assert 0.03 - worst_usd < sa["spent_usd"] <= 0.03, sa
    assert sb["end_reason"] == "run_budget"
    assert 0.07 - worst_usd < sb["run_spent_usd"] <= 0.07, sb
    assert sc["end_reason"] == "run_budget" and sc["results"] == 0
    # Money spent is spent: every billed answer is in the count, what the provider billed is ours.
    billed = fleet.sim_stats()["billed_cost_usd"]
    assert billed == pytest.approx(sb["run_spent_usd"], abs=1e-6) and billed <= 0.07
    fleet.assert_exactly_once(redis_client, "A_usd")
    fleet.assert_exactly_once(redis_client, "B_run")
    assert "A_usd: dollar budget reached" in out and "C_after: run dollar budget reached" in out


@pytest.mark.parametrize(("budget", "max_tokens"), [(20_000, 1024), (30_000, 8192)])
def test_small_token_budgets_end_within_one_worst_case_never_over(
        fleet: Fleet, redis_client: redis.Redis, budget: int, max_tokens: int) -> None:
    fleet.start_simulator("--latency-median-ms", "50")
    config = with_sections(fleet.one_dataset("T", 2_000, budget_tokens=budget), "", max_tokens=max_tokens)
    fleet.start_worker("w1", concurrency=40)
    fleet.run_producer(config)

    s = read_summary(fleet.out, "T")
    rows = fleet.assert_exactly_once(redis_client, "T")
    print(f"T: {s['tokens']} of {budget} ({s['tokens'] / budget:.1%}) in {len(rows)} rows, max_tokens {max_tokens}")
    assert s["end_reason"] == "budget" and s["budget_mode"] == "hard"
    assert budget - POLICY.worst_tokens(max_tokens) < s["tokens"] <= budget, s
    snap = Budget(redis_client, "T").snapshot()
    assert snap.reserved_tokens == 0 and snap.in_flight == 0


def test_resume_continues_dollars_even_after_redis_lost_them(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20")
    data = write_jsonl(fleet.tmp / "r.jsonl", prompts(300, "r"))

    def config(usd: float) -> Path:
        return with_sections(fleet.write_config([{"name": "R", "path": data, "length": "short",
                                                  "budget_usd": usd}]), PRICING)

    fleet.start_worker("w1", concurrency=20)
    fleet.run_producer(config(0.01), name="producer1")
    first = read_summary(fleet.out, "R")
    assert first["end_reason"] == "budget_usd" and first["spent_usd"] <= 0.01
    rows = fleet.assert_exactly_once(redis_client, "R")
    redis_client.flushdb()  # a Redis without persistence restarted: the dollars come back from the rows
    fleet.run_producer(config(0.02), name="producer2")
    assert "restoring from the shards" in fleet.log("producer2")
    second = read_summary(fleet.out, "R")
    assert second["end_reason"] == "budget_usd" and second["results"] > len(rows)
    # Every answer was kept, so the rows' costs are every dollar billed: the count continued exactly.
    assert sum(r["usage"]["cost"] for r in rows) == pytest.approx(first["spent_usd"], abs=1e-8)
    billed = fleet.sim_stats()["billed_cost_usd"]
    assert second["spent_usd"] == pytest.approx(billed, abs=1e-8) and billed <= 0.02
    fleet.assert_exactly_once(redis_client, "R")
