"""End to end, real processes: a run in engine mode (``model.upstream = "vllm"``) against the
simulator injecting non-canonical tokenizations. Every row is kept; the rows flagged
``engine_mismatch`` are exactly the generations the simulator injected into (matched by generation
id), at the injected position; every other row's ids are what re-encoding its text gives."""

from __future__ import annotations

from typing import Any

import redis
import requests
from tokenizers import Tokenizer

from tests.fleet import DEMO_TOKENIZER, TEST_KEY, Fleet, read_summary

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

N_PROMPTS = 150
NONCANONICAL_RATE = 0.15


def engine_mode(config_text: str) -> str:
    return config_text.replace("[model]\n", '[model]\nupstream = "vllm"\n', 1)


def test_engine_mode_flags_exactly_the_injected_rows(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--noncanonical-rate", str(NONCANONICAL_RATE))
    config = fleet.one_dataset("E", N_PROMPTS)
    config.write_text(engine_mode(config.read_text()))
    # No OpenRouter key on the worker: an engine run needs only the engine's URL (and its key here,
    # because the simulator wants a bearer token).
    fleet.start_worker("w1", concurrency=20, OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=fleet.sim_url + "/api/v1",
                       SPECFLEET_ENGINE_API_KEY=TEST_KEY)
    fleet.run_producer(config)
    rows = fleet.assert_exactly_once(redis_client, "E", N_PROMPTS)

    stats = requests.get(fleet.sim_url + "/_sim/stats", params={"detail": 1}, timeout=10).json()
    injections = {g["id"]: g["noncanonical"] for g in stats["generations"] if g["noncanonical"]}
    assert set(stats["noncanonical_generations"]) == set(injections)
    kept = {r["generation_id"]: r for r in rows}
    injected_kept = set(injections) & set(kept)
    flagged = {gid for gid, r in kept.items() if not r["engine_check"]["match"]}
    assert injected_kept and flagged == injected_kept
    for gid in flagged:
        check, injection = kept[gid]["engine_check"], injections[gid]
        assert (check["position"], check["engine_id"], check["rebuilt_id"]) == (
            injection["position"], injection["ids"][0], injection["canonical_id"])

    tok = Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    for r in rows:
        assert r["engine_check"]["prompt_match"] and r["provider"]
        prompt_len = r["loss_mask"].index(1)
        completion: list[Any] = r["input_ids"][prompt_len:]
        canonical = tok.encode(tok.decode(completion, skip_special_tokens=False), add_special_tokens=False).ids
        # Independent of the worker's check: a row not flagged holds the canonical ids of its text.
        assert (canonical == completion) == (r["generation_id"] not in flagged)

    summary = read_summary(fleet.out, "E")
    assert (summary["engine_rows"], summary["engine_mismatch"], summary["engine_prompt_mismatch"]) == (
        N_PROMPTS, len(injected_kept), 0)
    assert summary["failed"] == 0
    report = (fleet.out / "report.md").read_text()
    assert f"`engine_mismatch` {len(injected_kept):,} ({len(injected_kept) / N_PROMPTS:.2%} of them" in report
