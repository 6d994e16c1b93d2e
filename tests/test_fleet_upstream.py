"""End to end, real processes: a wrong URL or model is the fleet's problem, not the prompts'."""

from __future__ import annotations

import re

import redis

from tests.fleet import Fleet, read_summary

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

MODEL = "moonshotai/kimi-k2.5"
N_PROMPTS = 60
CONCURRENCY = 10


def test_the_documented_base_url_works_and_a_wrong_model_halts_then_resumes(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--models", MODEL)
    config = fleet.one_dataset("M", N_PROMPTS)
    good = config.read_text()
    config.write_text(good.replace(f'name = "{MODEL}"', 'name = "moonshotai/kimi-k2.5-typo"'))
    # OpenRouter's documented base URL, as the OpenAI SDK takes it (with a trailing slash even).
    fleet.start_worker("w1", concurrency=CONCURRENCY, OPENROUTER_BASE_URL=fleet.sim_url + "/api/v1/")

    # The plan would refuse the unknown id before any request (tests/test_plan.py); here the
    # workers meet it, as they would behind an engine that publishes no model list.
    producer = fleet.start_producer(config, "producer1", "--no-plan")
    assert producer.wait(timeout=120) == 3, fleet.all_logs()
    halted = [ln for ln in fleet.log("producer1").splitlines() if ln.startswith("specfleet: halted:")]
    assert len(halted) == 1, fleet.log("producer1")
    assert f"{fleet.sim_url}/api/v1/chat/completions with model 'moonshotai/kimi-k2.5-typo'" in halted[0]
    assert len(re.findall("http_404", halted[0])) == 1  # the reason said once
    assert redis_client.hlen("specfleet:ds:M:failed") == 0  # no prompt blamed for the configuration
    # The in-flight handful and their retries until the halt, not every prompt on its own.
    assert fleet.sim_stats()["requests"] <= 2 * CONCURRENCY

    config.write_text(good)  # the user fixes the model; the same command resumes
    fleet.run_producer(config, name="producer2")
    fleet.assert_exactly_once(redis_client, "M", N_PROMPTS)
    assert read_summary(fleet.out, "M")["failed"] == 0
