"""End to end, real processes (issue 25): the run manifest names what made the rows, a pinned run keeps
only its provider's rows, an unpinned one reports its mix, and rows cut by max_tokens are counted
and go where ``[request] truncated`` says."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from common.budget import Budget
from common.keys import DatasetKeys
from tests.fleet import DEMO_TOKENIZER, Fleet, read_rows, read_summary, write_jsonl

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

MODEL = "moonshotai/kimi-k2.5"
#: Two providers of the model at different quantizations (the simulator's endpoints list).
TWO_PROVIDERS = ("--providers", "Alpha Cloud,Beta", "--provider-quantizations", "fp8,bf16")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _scripted(i: int, **script: Any) -> dict[str, Any]:
    return {"id": f"s{i}", "messages": [{"role": "user", "content": f"#sim {json.dumps(script)} prompt {i}"}]}


def _plain(i: int) -> dict[str, Any]:
    return {"id": f"p{i}", "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}


def _dataset(fleet: Fleet, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "path": write_jsonl(fleet.tmp / f"{name}.jsonl", rows), "length": "short"}


def _failures(out: Path, dataset: str) -> list[dict[str, Any]]:
    lines = (out / dataset / "failed.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


# --- the manifest -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_run_writes_its_manifest_with_the_tokenizer_and_template_hashes_and_every_row_names_it(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--models", MODEL)
    config = fleet.write_config([_dataset(fleet, "M", [_plain(i) for i in range(30)])],
                                request='temperature = 0.7\nseed = 7\nprovider = { data_collection = "deny" }',
                                truncated=None)  # the product's default
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config)

    manifest = json.loads((fleet.out / "manifest.json").read_text())
    # The tokenizer's files and its chat template, hashed here from the files themselves.
    files = {p.name: _sha256(p) for p in sorted(DEMO_TOKENIZER.iterdir()) if p.is_file()}
    assert manifest["tokenizer"] == {"source": str(DEMO_TOKENIZER), "revision": None, "files": files}
    template = json.loads((DEMO_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]
    assert manifest["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert manifest["model"] == MODEL
    assert manifest["request"] == {"temperature": 0.7, "seed": 7, "max_tokens": {"short": 1024},
                                   "upstream": "openrouter"}
    assert manifest["provider"] == {"data_collection": "deny", "enforce_distillable_text": True}
    assert (manifest["providers_policy"], manifest["truncated_policy"]) == ("route", "separate")
    assert manifest["specfleet_version"] and manifest["started_at"] <= manifest["ended_at"]
    # The id: the first 12 hex of the sha256 of the identity as canonical JSON (common/manifest.py).
    identity = {"model": MODEL, "tokenizer_files": files, "chat_template_sha256": manifest["chat_template_sha256"],
                "request": manifest["request"], "provider": manifest["provider"], "providers_policy": "route"}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert manifest["manifest_id"] == hashlib.sha256(canonical.encode()).hexdigest()[:12]

    rows = read_rows(fleet.out, "M")  # the shards' and truncated.jsonl's
    assert len(rows) == 30
    assert {r["manifest"] for r in rows} == {manifest["manifest_id"]}
    ds = manifest["datasets"]["M"]
    assert ds["budget_tokens"] == 10_000_000 and sum(ds["providers"].values()) == 30
    assert ds["truncated"] == sum(r["finish_reason"] == "length" for r in rows)
    report = (fleet.out / "report.md").read_text()
    assert f"manifest `{manifest['manifest_id']}`" in report and manifest["chat_template_sha256"][:12] in report

    # A resumed run of the same configuration keeps the id and the first start.
    fleet.run_producer(config, name="producer2")
    again = json.loads((fleet.out / "manifest.json").read_text())
    assert again["manifest_id"] == manifest["manifest_id"] and again["started_at"] == manifest["started_at"]
    # Another configuration: a new id, and the old manifest kept beside it for the rows that name it.
    config.write_text(config.read_text().replace("temperature = 0.7", "temperature = 0.9"))
    fleet.run_producer(config, name="producer3")
    third = json.loads((fleet.out / "manifest.json").read_text())
    assert third["manifest_id"] != manifest["manifest_id"]
    assert (fleet.out / f"manifest-{manifest['manifest_id']}.json").is_file()


def _truncated_rows(out: Path, dataset: str) -> list[dict[str, Any]]:
    path = out / dataset / "truncated.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# --- providers by choice ----------------------------------------------------------------------------


@pytest.mark.long
def test_the_simulator_lists_two_providers_and_honours_only_without_fallbacks(fleet: Fleet) -> None:
    url = fleet.start_simulator(*TWO_PROVIDERS)
    listed = requests.get(f"{url}/api/v1/models/{MODEL}/endpoints", timeout=5).json()["data"]["endpoints"]
    assert [(e["provider_name"], e["quantization"]) for e in listed] == [("Alpha Cloud", "fp8"), ("Beta", "bf16")]

    def ask(i: int, provider: dict[str, Any] | None) -> requests.Response:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 64,
                                "messages": [{"role": "user", "content": f"hello {i}"}]}
        if provider is not None:
            body["provider"] = provider
        return requests.post(f"{url}/api/v1/chat/completions", json=body, timeout=30,
                             headers={"Authorization": "Bearer sk-test"})

    assert {ask(i, {"only": ["beta"], "allow_fallbacks": False}).json()["provider"] for i in range(20)} == {"Beta"}
    assert {ask(i, None).json()["provider"] for i in range(40)} == {"Alpha Cloud", "Beta"}
    assert {ask(i, {"order": ["Beta"], "allow_fallbacks": False}).json()["provider"] for i in range(10)} == {"Beta"}
    refused = ask(0, {"only": ["Gamma"]})
    assert refused.status_code == 404 and "No endpoints found" in refused.text


@pytest.mark.timeout(300)
def test_a_pinned_run_keeps_only_the_pinned_providers_rows_and_reports_the_refusals(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", *TWO_PROVIDERS)
    # Four answers come from the other provider whatever the request asked (a fallback that should
    # not happen): the pin refuses them. Every other answer is routed by provider.only.
    rows = [_plain(i) for i in range(40)] + [_scripted(i, provider="Alpha Cloud") for i in range(4)]
    config = fleet.write_config([_dataset(fleet, "P", rows)], request='providers = "pin"\nprovider_pin = "Beta"')
    fleet.start_worker("w1", concurrency=10)
    out = fleet.run_producer(config)
    assert "Beta · bf16" in out and "pinned (run file)" in out  # the plan's endpoints, the pin marked

    kept = fleet.assert_exactly_once(redis_client, "P", 40)
    assert {(r["provider"], r.get("quantization")) for r in kept} == {("Beta", "bf16")}
    refused = _failures(fleet.out, "P")
    assert sorted(f["id"] for f in refused) == [f"s{i}" for i in range(4)]
    assert {f["reason"] for f in refused} == {"provider_refused"}
    summary = read_summary(fleet.out, "P")
    assert summary["failures"] == {"provider_refused": 4}
    assert summary["providers"] == {"Beta|bf16": 40} and summary["provider_warning"] is None
    assert summary["requests"] == 44  # the refused answers were billed and are counted
    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["providers_policy"] == "pin"
    assert manifest["provider"] == {"only": ["Beta"], "allow_fallbacks": False, "enforce_distillable_text": True}
    assert manifest["datasets"]["P"]["providers"] == {"Beta|bf16": 40}
    assert "provider_refused" in (fleet.out / "report.md").read_text()


@pytest.mark.timeout(300)
def test_a_pin_without_a_name_is_the_plans_cheapest_endpoint(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", *TWO_PROVIDERS)
    config = fleet.write_config([_dataset(fleet, "C", [_plain(i) for i in range(10)])], request='providers = "pin"')
    fleet.start_worker("w1", concurrency=10)
    out = fleet.run_producer(config)
    # Both list the same price: the first listed wins the tie.
    assert "pinned (cheapest)" in out
    assert read_summary(fleet.out, "C")["providers"] == {"Alpha Cloud|fp8": 10}


@pytest.mark.timeout(300)
def test_an_unpinned_run_reports_its_provider_mix_and_warns(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", *TWO_PROVIDERS)
    config = fleet.write_config([_dataset(fleet, "U", [_plain(i) for i in range(40)])])
    fleet.start_worker("w1", concurrency=10)
    out = fleet.run_producer(config)

    rows = read_rows(fleet.out, "U")
    by_row = {f"{r['provider']}|{r['quantization']}" for r in rows}
    assert by_row == {"Alpha Cloud|fp8", "Beta|bf16"}
    summary = read_summary(fleet.out, "U")
    assert set(summary["providers"]) == by_row and sum(summary["providers"].values()) == 40
    assert "2 providers / 2 quantizations" in summary["provider_warning"]
    assert "U: rows from 2 providers / 2 quantizations" in out  # the warning in the producer's log
    assert "**warning**: rows from 2 providers" in (fleet.out / "report.md").read_text()
    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["datasets"]["U"]["providers"] == summary["providers"]


# --- truncation ---------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", ["keep", "separate", "drop"])
def test_truncated_rows_are_counted_and_go_where_the_policy_says(
        fleet: Fleet, redis_client: redis.Redis, policy: str) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--models", MODEL)
    cut = [_scripted(i, finish_reason="length", reasoning="thinking and thinking", content="half an ans")
           for i in range(5)]
    whole = [_scripted(100 + i, finish_reason="stop", content=f"a whole answer {i}") for i in range(15)]
    config = fleet.write_config([_dataset(fleet, "T", cut + whole)], request=f'truncated = "{policy}"')
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config)

    shards = read_rows(fleet.out, "T", truncated=False)
    separated = _truncated_rows(fleet.out, "T")
    dropped_path = fleet.out / "T" / "dropped.jsonl"
    dropped = [json.loads(x) for x in dropped_path.read_text().splitlines()] if dropped_path.exists() else []
    cut_ids = {f"s{i}" for i in range(5)}
    in_shards = {r["id"] for r in shards if r["finish_reason"] == "length"}
    if policy == "keep":
        assert in_shards == cut_ids and not separated and not dropped
    elif policy == "separate":
        assert not in_shards and not dropped
        assert {r["id"] for r in separated} == cut_ids
        assert all(r["input_ids"] and sum(r["loss_mask"]) == r["num_tokens"] for r in separated)  # full rows
    else:
        assert not in_shards and not separated
        assert {r["id"] for r in dropped} == cut_ids
        assert all("input_ids" not in r and r["num_tokens"] > 0 for r in dropped)  # stubs: no text, no ids
    assert len(shards) == (20 if policy == "keep" else 15)

    # The budget counted what it counted before: every billed row, wherever it went.
    snap = Budget(redis_client, "T").snapshot()
    assert snap.rows == 20
    assert snap.kept_tokens == sum(r["num_tokens"] for r in shards + separated + dropped)
    summary = read_summary(fleet.out, "T")
    assert (summary["truncated"], summary["truncated_rows"], summary["truncated_policy"]) == (5, 5, policy)
    assert summary["results"] == 20
    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["datasets"]["T"]["truncated"] == 5 and manifest["truncated_policy"] == policy
    assert f"truncated (finish_reason length) 5 rows, `{policy}`" in (fleet.out / "report.md").read_text()

    # A resumed run asks nothing again: the separated and dropped rows are kept rows.
    before = fleet.sim_stats()["requests"]
    redis_client.flushdb()  # and rebuilds the budget from the folder alone
    fleet.run_producer(config, name="producer2")
    assert fleet.sim_stats()["requests"] == before
    assert Budget(redis_client, "T").snapshot().rows == 20


def test_the_plans_pin_is_the_lowest_completion_then_prompt_price_and_names_compare_folded() -> None:
    from common.config import Pricing
    from common.providers import provider_key, quantization_of
    from producer.models import Endpoint
    from producer.providers import cheapest

    def ep(name: str, prompt: float, completion: float) -> Endpoint:
        return Endpoint(name, "fp8", None, Pricing(prompt=prompt / 1e6, completion=completion / 1e6))

    listed = [ep("A", 0.5, 3.0), ep("B", 0.9, 2.0), ep("C", 0.4, 2.0), Endpoint("D", "fp4", None, None)]
    assert [cheapest(listed), cheapest([ep("A", 1, 1), ep("B", 1, 1)])] == [listed[2], ep("A", 1, 1)]
    assert cheapest([Endpoint("D", "fp4", None, None)]) is None
    assert provider_key("Deep Infra") == provider_key("deepinfra/fp4") == provider_key("DeepInfra") == "deepinfra"
    assert quantization_of({"DeepInfra": "fp4"}, "deep-infra") == "fp4" and quantization_of(None, "x") == "?"


def test_a_pin_on_a_provider_that_does_not_serve_the_model_is_refused_before_any_request(fleet: Fleet) -> None:
    fleet.start_simulator(*TWO_PROVIDERS)
    config = fleet.write_config([_dataset(fleet, "G", [_plain(i) for i in range(3)])],
                                request='providers = "pin"\nprovider_pin = "Gamma"')
    proc = fleet.start_producer(config)
    assert proc.wait(timeout=120) == 2, fleet.log("producer")
    assert "provider_pin 'Gamma' does not serve moonshotai/kimi-k2.5 (its endpoints: Alpha Cloud, Beta)" in \
        fleet.log("producer")
    assert fleet.sim_stats()["requests"] == 0


@pytest.mark.timeout(300)
def test_rows_a_killed_run_left_in_redis_do_not_reach_another_configs_folder(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """A run killed before it wrote its rows leaves them in Redis (the results stream is per dataset
    name). Run again with another config into another folder, those rows named a manifest that
    folder does not hold: they are left out and their prompts asked again, so every row there is
    the new run's, and the warning says how many."""
    import signal

    from common.manifest import read_manifest
    from producer.validate import validate

    fleet.start_simulator("--latency-median-ms", "300")
    fleet.start_worker("w1", concurrency=20)
    first = fleet.one_dataset("M", 200)
    fleet.start_producer(first, "killed")
    fleet.wait_rows(redis_client, "M", 30, timeout_s=120)
    fleet.signal("killed", signal.SIGKILL)
    # The worker goes on settling what it holds: rows wait in the stream with nobody to write them.
    results = DatasetKeys("M").results
    fleet.wait_for(lambda: redis_client.xlen(results) >= 10, 60, "rows left in the stream")
    other = fleet.tmp / "other-out"
    second = first.with_name("second.toml")
    second.write_text(first.read_text().replace("temperature = 1.0", "temperature = 0.5")
                      .replace(f'dir = "{fleet.out}"', f'dir = "{other}"'))
    log = fleet.run_producer(second, timeout_s=240, name="second")
    manifest = read_manifest(other / "manifest.json")
    rows = read_rows(other, "M")
    assert len(rows) == 200 and {r["manifest"] for r in rows} == {manifest.manifest_id}, \
        sorted({r["manifest"] for r in rows})
    assert len({r["id"] for r in rows}) == 200
    assert "made under a manifest this folder does not hold" in log, log[-3000:]
    report = validate(other)
    assert report.ok, [str(d) for d in report.defects[:5]]
