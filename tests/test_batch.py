"""Batch mode end to end on a real fleet: producer, gevent workers, the simulator's Batch API over HTTP."""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import pytest
import redis
import requests

from common import keys
from common.batches import open_batches
from common.budget import POLICY
from harness import zygote
from tests.fleet import REPO, TEST_KEY, Fleet, read_summary, write_jsonl

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

BATCH_REQUEST = "\n".join(['temperature = 1.0', 'mode = "batch"', "batch_size = 40", "batch_gather_s = 1.0",
                           "batch_poll_s = 1.0"])
FAST = ("--latency-median-ms", "20", "--batch-validate-s", "0.5", "--batch-run-s", "2", "--batch-finalize-s", "0.2")


def _batches(fleet: Fleet) -> dict[str, Any]:
    out: dict[str, Any] = requests.get(fleet.sim_url + "/_sim/batches", timeout=10).json()
    return out


def _listed(fleet: Fleet) -> list[dict[str, Any]]:
    resp = requests.get(fleet.sim_url + "/api/v1/batches", params={"limit": "1000"},
                        headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=10)
    data: list[dict[str, Any]] = resp.json()["data"]
    return data


def test_a_batch_run_keeps_every_prompt_once_at_half_the_price(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator(*FAST)
    config = fleet.one_dataset("B", 150, request=BATCH_REQUEST)
    fleet.start_worker("w1", concurrency=60)
    fleet.start_worker("w2", concurrency=60)
    out = fleet.run_producer(config, timeout_s=240)
    rows = fleet.assert_exactly_once(redis_client, "B", 150)
    s = read_summary(fleet.out, "B")
    assert s["end_reason"] == "complete", out
    sim, batches = fleet.sim_stats(), _batches(fleet)
    assert sim["requests"] == 0, "a batch-mode dataset sent a live request"
    assert batches["repeated_custom_ids"] == {} and batches["submitted_custom_ids"] == 150
    assert batches["batches"] >= 4  # batch_size 40
    assert s["batch_requests"] == 150 and s["batch_results"] == 150 and s["batch_returned"] == 0
    # Per-row cost: its tokens at the batch price (half the live price); the batches' usage.cost agrees.
    live_prompt, live_completion = 0.60 / 1e6, 2.50 / 1e6
    for r in rows:
        u = r["usage"]
        assert u["cost"] == pytest.approx((u["prompt_tokens"] * live_prompt + u["completion_tokens"]
                                           * live_completion) / 2, rel=1e-6)
    assert s["batch_cost_usd"] == pytest.approx(s["batch_rows_cost_usd"], abs=1e-5)
    assert s["batch_cost_usd"] == pytest.approx(batches["billed_cost_usd"], abs=1e-5)
    assert s["cost_usd"] == pytest.approx(s["batch_rows_cost_usd"], abs=1e-5)
    assert not open_batches(redis_client) and not redis_client.hlen(keys.DatasetKeys("B").batched)
    # Every settled batch was deleted at OpenRouter: nothing of the run left stored there.
    assert batches["deleted"] == batches["batches"] and _listed(fleet) == [], (batches, _listed(fleet))
    assert all(r["generation_id"].startswith("gen-batch-") for r in rows)


@pytest.mark.long
def test_a_crash_between_post_and_record_finds_the_batch_instead_of_posting_again(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """The simulator stores the batch and holds its answer; the worker is SIGKILLed while it waits, so
    the batch id is never recorded. Another worker finds the batch by created_after and settles it:
    nothing is posted twice."""
    fleet.start_simulator(*FAST, "--batch-submit-delay-s", "60")
    config = fleet.one_dataset("C", 30, request=BATCH_REQUEST.replace("batch_size = 40", "batch_size = 30"))
    fleet.start_worker("w1", concurrency=40, SPECFLEET_BATCH_SUBMIT_TIMEOUT_S="4")
    producer = fleet.start_producer(config)
    fleet.wait_for(lambda: _batches(fleet)["batches"] == 1, 120, "the batch to be stored")
    fleet.procs["w1"].send_signal(signal.SIGKILL)
    fleet.procs["w1"].wait()
    intents = [redis_client.hgetall(keys.BatchKeys(i.decode()).record)
               for i in redis_client.zrange(keys.BATCHES_OPEN, 0, -1)]
    assert [i[b"state"] for i in intents] == [b"posting"], intents  # the POST landed, its id was never recorded
    fleet.sim_config(batch_submit_delay_s=0)
    fleet.start_worker("w2", concurrency=40, SPECFLEET_BATCH_SUBMIT_TIMEOUT_S="4")
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "C", 30)
    assert _batches(fleet)["batches"] == 1 and _batches(fleet)["repeated_custom_ids"] == {}
    assert "found it as batch_" in fleet.log("w2"), fleet.log("w2")


@pytest.mark.long
def test_lost_posts_of_one_size_each_find_their_own_batch_by_custom_id(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """Four batches of the same model and size lose their POST's answer: the first two POSTs never
    reached the store, the other two did. Model and size alone would hand a stored batch to an intent
    whose POST was dropped (whichever is recovered first claims the oldest) and post the stored one's
    requests again, billing them twice; the custom_ids tell them apart, so the two dropped ones are
    posted once each and the two stored ones find their batches."""
    fleet.start_simulator(*FAST, "--batch-submit-delay-s", "60", "--batch-submit-drop", "2")
    config = fleet.one_dataset("T", 60, request=BATCH_REQUEST.replace("batch_size = 40", "batch_size = 15"))
    fleet.start_worker("w1", concurrency=80, SPECFLEET_BATCH_SUBMIT_TIMEOUT_S="4")
    producer = fleet.start_producer(config)
    fleet.wait_for(lambda: _batches(fleet)["batches"] == 2 and _batches(fleet)["dropped_posts"] == 2, 120,
                   "two POSTs dropped and two stored, every answer held")
    fleet.procs["w1"].send_signal(signal.SIGKILL)
    fleet.procs["w1"].wait()
    states = [redis_client.hget(keys.BatchKeys(i.decode()).record, "state")
              for i in redis_client.zrange(keys.BATCHES_OPEN, 0, -1)]
    assert states == [b"posting"] * 4, states
    fleet.sim_config(batch_submit_delay_s=0)
    fleet.start_worker("w2", concurrency=40, SPECFLEET_BATCH_SUBMIT_TIMEOUT_S="4")
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "T", 60)
    stats = _batches(fleet)
    assert stats["repeated_custom_ids"] == {}, stats  # no request submitted (and billed) twice
    assert stats["batches"] == 4 and stats["submitted_custom_ids"] == 60, stats
    log = fleet.log("w2")
    assert log.count("found it as batch_") == 2 and log.count("not found at OpenRouter") == 2, log


def test_an_invalid_request_fails_alone_and_the_rest_are_asked_again(fleet: Fleet, redis_client: redis.Redis) -> None:
    """One request the Batch API's validation refuses fails its whole batch: that prompt fails
    (batch_invalid, named by custom_id), the others are given back and kept in a later batch."""
    fleet.start_simulator(*FAST, "--context-length", "2000")
    # The demo tokenizer counts ~1 token a word: this prompt passes the worker's own check only
    # because the run file says no context length; the API counts and refuses it.
    rows: list[dict[str, Any]] = [
        {"id": f"v{i:03d}", "messages": [{"role": "user", "content": "word " * 1500 if i == 7 else f"Question {i}"}]}
        for i in range(20)]
    data = write_jsonl(fleet.tmp / "v.jsonl", rows)
    config = fleet.write_config([{"name": "V", "path": data, "length": "short"}],
                                request=BATCH_REQUEST.replace("batch_size = 40", "batch_size = 20"))
    text = config.read_text().replace("[model]\n", "[model]\ncontext_length = 1000000\n", 1)
    config.write_text(text)
    fleet.start_worker("w1", concurrency=40)
    fleet.run_producer(config, timeout_s=240)
    s = read_summary(fleet.out, "V")
    kept = fleet.assert_exactly_once(redis_client, "V")
    assert len(kept) == 19 and s["failed"] == 1, s
    failed = [json.loads(line) for line in (fleet.out / "V" / "failed.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failed] == ["v007"] and failed[0]["reason"] == "batch_invalid", failed
    assert s["batch_returned"] == 19 and s["batch_failed"] == 1
    assert _batches(fleet)["by_status"].get("failed") == 1


def test_an_expired_batch_settles_what_it_returned_and_gives_the_rest_back(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator(*FAST)
    fleet.sim_config(batch_expire_rate=1.0, batch_expire_done=0.5)
    config = fleet.one_dataset("E", 40, request=BATCH_REQUEST)
    fleet.start_worker("w1", concurrency=50)
    producer = fleet.start_producer(config)
    # The first batch expires with half its results; then batches complete again.
    fleet.wait_for(lambda: _batches(fleet)["by_status"].get("expired", 0) >= 1, 120, "a batch to expire")
    fleet.sim_config(batch_expire_rate=0.0)
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "E", 40)
    s = read_summary(fleet.out, "E")
    assert s["batch_returned"] >= 20 and s["batch_results"] == 40, s
    # The returned prompts were asked again: submitted twice only after the expired batch.
    repeated = _batches(fleet)["repeated_custom_ids"]
    assert 0 < len(repeated) <= s["batch_returned"]


@pytest.mark.long
def test_a_hard_budget_stops_inside_a_batch_never_over(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator(*FAST)
    budget = 30_000
    # tail = "batch": the batch path's own stop (under the default, a budget of less than a full
    # batch's worst cases goes live from the start: tests/test_batch_tail.py).
    config = fleet.one_dataset("H", 400, budget_tokens=budget, request=BATCH_REQUEST + '\ntail = "batch"')
    fleet.start_worker("w1", concurrency=60)
    fleet.run_producer(config, timeout_s=300)
    s = read_summary(fleet.out, "H")
    fleet.assert_exactly_once(redis_client, "H")
    assert s["end_reason"] == "budget", s
    assert budget - POLICY.worst_tokens(1024) < s["tokens"] <= budget, s
    assert s["results"] + s["skipped"] + s["failed"] == 400, s
    assert _batches(fleet)["repeated_custom_ids"] == {}


def test_batch_mode_with_a_model_without_a_batch_variant_is_refused_before_anything_is_sent(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator(*FAST, "--batch-models", "someone/else")
    config = fleet.one_dataset("R", 5, request=BATCH_REQUEST)
    proc = fleet.start_producer(config)
    proc.wait(timeout=120)
    assert proc.returncode == 2, fleet.log("producer")
    assert "has no :batch variant" in fleet.log("producer")
    assert fleet.sim_stats()["requests"] == 0 and _batches(fleet)["batches"] == 0


def test_the_plan_shows_both_prices_the_saving_and_which_datasets_use_batch(fleet: Fleet) -> None:
    fleet.start_simulator(*FAST)
    a = write_jsonl(fleet.tmp / "a.jsonl", [{"id": f"a{i}", "messages": [{"role": "user", "content": f"q {i}"}]}
                                           for i in range(20)])
    config = fleet.write_config([{"name": "Auto", "path": a, "length": "short", "mode": "auto"},
                                 {"name": "Live", "path": a, "length": "short"}])
    proc = zygote.run([sys.executable, "-m", "producer.cli", "plan", str(config)], env=fleet.env(), cwd=REPO,
                      timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Auto: batch mode" in out and "batch saves" in out and "(50%)" in out, out
    assert 'Live: live mode' in out and 'can use the Batch API' in out, out
    assert fleet.sim_stats()["requests"] == 0 and _batches(fleet)["batches"] == 0
