"""Data worth training on (issue 38, the request and worker side): a model not licensed to distill is
refused before any request and every request carries OpenRouter's routing flag; degenerate answers
are marked on their row and routed by ``[request] degenerate``; a dataset's sampling mixture picks
each prompt's recipe by a stable hash of its id, sends it, and records it on the row and in the
manifest. Fleet tests run the real producer, workers and simulator."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from common.config import RunConfig, SamplingRecipe
from common.quality import quality_of, repeated_share
from common.sampling import position, recipe_for
from producer.export import export
from producer.rows import DEGENERATE_FILE, DROPPED_FILE, TRUNCATED_FILE, JsonlShards
from producer.validate import validate
from simulator.answers import degenerate_kind
from simulator.seeding import prompt_hash
from simulator.settings import SimSettings
from tests.fleet import TEST_KEY, Fleet, prompts, read_rows, read_summary, write_jsonl

MODEL = "moonshotai/kimi-k2.5"


class _Toml:
    """A value the harness writes as it is (a TOML inline array), not as a quoted string."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _answer(reasoning: str | None, content: str | None, finish: str = "stop", calls: Any = None) -> Any:
    from workers.upstreams.upstream import Answer

    return Answer(reasoning=reasoning, content=content, tool_calls=calls, finish_reason=finish)


# --- degenerate answers ---------------------------------------------------------------------------


def test_each_degenerate_kind_is_told_apart_from_ordinary_answers() -> None:
    sentence = "I need to check the answer again before I reply to the user."
    loop = " ".join([sentence] * 12)
    prose = " ".join(f"word{i} follows {i % 7} and then" for i in range(60))  # repeats 3-grams, not 8-grams
    assert quality_of(_answer("thinking it over", loop)) == {"degenerate": "repetition", "covered": 1.0}
    assert quality_of(_answer(loop, "Fine.")) == {"degenerate": "repetition", "covered": 1.0}  # looping reasoning
    assert quality_of(_answer("thinking", loop, finish="length"))["degenerate"] == "repetition"  # type: ignore[index]
    assert quality_of(_answer("thinking it over", "")) == {"degenerate": "empty_content"}
    assert quality_of(_answer("thinking it over", "  \n")) == {"degenerate": "empty_content"}
    assert quality_of(_answer("thinking it over", None)) == {"degenerate": "unclosed_reasoning"}
    # Not degenerate: an answer, a tool call after reasoning, a cut reasoning (truncated's), prose.
    assert quality_of(_answer("thinking it over", prose)) is None and repeated_share(prose) == 0
    assert quality_of(_answer("thinking", None, finish="tool_calls", calls=[{"id": "c"}])) is None
    assert quality_of(_answer("thinking", None, finish="length")) is None
    assert quality_of(_answer(None, "Short answer.")) is None
    # Half an answer looping is not "most of it".
    assert quality_of(_answer(None, prose + " " + " ".join([sentence] * 3))) is None


def _row(pid: str, quality: str | None = None, finish: str = "stop") -> dict[str, Any]:
    row: dict[str, Any] = {"id": pid, "finish_reason": finish, "num_tokens": 3, "conversations": [],
                           "input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}
    if quality:
        row["quality"] = {"degenerate": quality}
    return row


@pytest.mark.parametrize("policy", ["keep", "separate", "drop"])
def test_degenerate_rows_go_where_the_policy_says(tmp_path: Path, policy: str) -> None:
    """Real files: the shards, degenerate.jsonl, dropped.jsonl's stubs; a row both cut and degenerate
    goes the stricter way; every row stays one the budget kept (``iter_kept``)."""
    rows = [_row("ok"), _row("loop", "repetition"), _row("empty", "empty_content"),
            _row("cut", finish="length"), _row("cut-loop", "repetition", finish="length")]
    writer = JsonlShards(tmp_path / policy, shard_rows=100, truncated="separate", degenerate=policy)
    writer.recover()
    writer.write(rows, "1-0")

    def ids(name: str) -> list[str]:
        path = tmp_path / policy / name
        return [json.loads(line)["id"] for line in path.read_text().splitlines()] if path.exists() else []

    shards = ids("shard-00000.jsonl")
    if policy == "keep":
        assert (shards, ids(DEGENERATE_FILE), ids(DROPPED_FILE)) == (["ok", "loop", "empty"], [], [])
        assert ids(TRUNCATED_FILE) == ["cut", "cut-loop"]
    elif policy == "separate":
        assert (shards, ids(DEGENERATE_FILE)) == (["ok"], ["loop", "empty"])
        assert ids(TRUNCATED_FILE) == ["cut", "cut-loop"] and ids(DROPPED_FILE) == []
    else:
        assert (shards, ids(DEGENERATE_FILE), ids(TRUNCATED_FILE)) == (["ok"], [], ["cut"])
        assert ids(DROPPED_FILE) == ["loop", "empty", "cut-loop"]
        stub = json.loads((tmp_path / policy / DROPPED_FILE).read_text().splitlines()[0])
        assert stub["quality"] == {"degenerate": "repetition"} and "input_ids" not in stub
    reopened = JsonlShards(tmp_path / policy, shard_rows=100, truncated="separate", degenerate=policy)
    assert sorted(r["id"] for r in reopened.iter_kept()) == sorted(r["id"] for r in rows)


@pytest.mark.fleet
def test_each_degenerate_kind_is_marked_and_set_apart(fleet: Fleet, redis_client: redis.Redis) -> None:
    """The simulator answers a share of prompts with each kind; ``degenerate = "separate"``: every
    such row (and no other) is marked with its kind and lands in degenerate.jsonl, none in the shards;
    the budget counted their tokens as kept, as truncated rows'."""
    fleet.start_simulator("--latency-median-ms", "20")
    rates = {"degenerate_repeat": 0.15, "degenerate_empty": 0.15, "degenerate_unclosed": 0.15}
    fleet.sim_config(rates=rates)
    rows = prompts(80, "q")
    data = write_jsonl(fleet.tmp / "q.jsonl", rows)
    # An unclosed reasoning is billed without the think-close the rebuild puts back (content null reads
    # as a closed, empty turn): its rows disagree with their usage, so the check flags, not halts.
    config = fleet.write_config([{"name": "Q", "path": data, "length": "short"}], degenerate="separate",
                                model='usage_check = "flag"')
    fleet.start_worker("w1", concurrency=20)
    fleet.run_producer(config)
    sim = SimSettings(rates=rates)

    class _Req:
        def __init__(self, messages: list[dict[str, Any]]) -> None:
            self.prompt_hash = prompt_hash(messages)

    reason = {"degenerate_repeat": "repetition", "degenerate_empty": "empty_content",
              "degenerate_unclosed": "unclosed_reasoning"}
    expected = {r["id"]: reason.get(degenerate_kind(sim, _Req(r["messages"])) or "") for r in rows}  # type: ignore[arg-type]
    assert set(expected.values()) == {None, *reason.values()}, expected
    shards = read_rows(fleet.out, "Q", truncated=False)
    apart = [json.loads(line) for line in (fleet.out / "Q" / DEGENERATE_FILE).read_text().splitlines()]
    assert all("quality" not in r for r in shards)
    got = {r["id"]: None for r in shards} | {r["id"]: r["quality"]["degenerate"] for r in apart}
    # A reasoning that ate max_tokens is cut before any kind could show (the truncated policy's row).
    cut_reasoning = {r["id"] for r in shards if r["reasoning_end"] == "truncated"}
    expected = {i: None if i in cut_reasoning else why for i, why in expected.items()}
    assert got == expected, {i: (why, got.get(i)) for i, why in expected.items() if got.get(i) != why}
    summary = read_summary(fleet.out, "Q")
    assert summary["results"] == 80 and summary["degenerate_policy"] == "separate"
    counts = {why: list(expected.values()).count(why) for why in reason.values()}
    assert summary["degenerate_rows"] == counts
    assert summary["tokens"] == sum(r["num_tokens"] for r in shards + apart)  # counted as kept, as truncated
    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["degenerate_policy"] == "separate" and manifest["datasets"]["Q"]["degenerate"] == counts
    # specfleet validate re-reads degenerate.jsonl too, and tells a marked row out of its place.
    checked = validate(fleet.out)
    assert checked.ok and sum(d.rows for d in checked.datasets) == 80, [str(d) for d in checked.defects[:5]]
    with (fleet.out / "Q" / "shard-00000.jsonl").open("a") as fh:
        fh.write(json.dumps(apart[0]) + "\n")
    defects = [str(d) for d in validate(fleet.out).defects]
    assert any("in a shard under degenerate = \"separate\"" in d for d in defects), defects


# --- licensed to distill ----------------------------------------------------------------------------


def _run(fleet: Fleet, config: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(fleet.producer_cmd(config), env=fleet.env(), capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_routing_flag_follows_allow_non_distillable_only() -> None:
    def cfg(model: dict[str, Any], provider: dict[str, Any] | None = None) -> RunConfig:
        return RunConfig.model_validate({"model": {"name": "m", "tokenizer": "t", **model},
                                         "request": {"provider": provider}, "datasets": [{"name": "a", "path": "x"}]})

    assert cfg({}, {"order": ["A"]}).worker_view().request["provider"] == {
        "order": ["A"], "enforce_distillable_text": True}
    assert "provider" not in cfg({"allow_non_distillable": True}).worker_view().request
    assert "provider" not in cfg({"upstream": "vllm"}).worker_view().request  # an engine routes nothing
    with pytest.raises(ValueError, match="contradicts"):
        cfg({}, {"enforce_distillable_text": False})


@pytest.mark.fleet
def test_a_model_not_licensed_to_distill_is_refused_before_any_request(fleet: Fleet) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--non-distillable-models", MODEL)
    listed = requests.get(fleet.sim_url + "/api/v1/models", timeout=5).json()["data"]
    assert [m["is_trainable_text"] for m in listed if m["id"] == MODEL] == [False]
    # The simulator routes as documented: with the flag, no endpoint qualifies.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    key = {"Authorization": f"Bearer {TEST_KEY}"}
    asked = requests.post(fleet.sim_url + "/api/v1/chat/completions", timeout=10, headers=key,
                          json={**body, "provider": {"enforce_distillable_text": True}})
    assert asked.status_code == 404 and "distillation" in asked.json()["error"]["message"]
    assert requests.post(fleet.sim_url + "/api/v1/chat/completions", json=body, headers=key,
                         timeout=10).status_code == 200
    requests.post(fleet.sim_url + "/_sim/reset", timeout=5).raise_for_status()

    data = write_jsonl(fleet.tmp / "d.jsonl", prompts(10, "d"))
    config = fleet.write_config([{"name": "D", "path": data, "length": "short"}])
    fleet.start_worker("w1", concurrency=10)
    refused = _run(fleet, config, "refused")
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [ln for ln in refused.stderr.splitlines() if ln.startswith("specfleet")]
    assert len(lines) == 1 and "does not allow its outputs to train other models" in lines[0], refused.stderr
    assert "allow_non_distillable = true" in lines[0]
    assert fleet.sim_requests() == []  # not one request
    assert not (fleet.out / "manifest.json").exists()

    # The owner's explicit choice: the run goes on, without the flag, and the manifest says so.
    config = fleet.write_config([{"name": "D", "path": data, "length": "short"}],
                                model="allow_non_distillable = true")
    log = fleet.run_producer(config)
    assert "· distillation not allowed" in log  # the plan's model line
    sent = fleet.sim_requests()
    assert len(sent) >= 10 and all("enforce_distillable_text" not in (r["params"].get("provider") or {})
                                   for r in sent)
    read = json.loads((fleet.out / "manifest.json").read_text())["distillation"]
    assert (read["is_trainable_text"], read["allow_non_distillable"], read["enforce_distillable_text"]) == (
        False, True, False)
    assert read["read_at"] and read["source"] == fleet.sim_url + "/api/v1/models"


# --- sampling recipes (and the flag on every request) ---------------------------------------------------


def test_a_prompts_recipe_is_its_ids_and_the_shares_hold() -> None:
    recipes = [SamplingRecipe(temperature=0, share=0.25, name="greedy"),
               SamplingRecipe(temperature=0.8, top_p=0.95, share=0.75)]
    # sha256, not Python's salted hash(): these values are the same in every process and release.
    assert [round(position(f"id-{i}"), 6) for i in range(4)] == [0.661151, 0.919537, 0.835292, 0.753372]
    picks = [recipe_for(recipes, f"id-{i}").label() for i in range(4000)]
    assert picks == [recipe_for(recipes, f"id-{i}").label() for i in range(4000)]
    assert 0.22 < picks.count("greedy") / 4000 < 0.28
    assert recipes[1].label() == "temperature=0.8,top_p=0.95"
    with pytest.raises(ValueError, match=r"sum to 0\.9"):
        RunConfig.model_validate({"model": {"name": "m", "tokenizer": "t"}, "datasets": [
            {"name": "a", "path": "x", "sampling": [{"temperature": 0, "share": 0.4},
                                                    {"temperature": 1, "share": 0.5}]}]})


_MIXTURE = _Toml('[{name = "greedy", temperature = 0, share = 0.5}, {temperature = 0.8, top_p = 0.95, share = 0.5}]')


@pytest.mark.fleet
def test_recipes_are_sent_stored_per_row_and_stable_across_a_rerun(fleet: Fleet, redis_client: redis.Redis) -> None:
    """Every request carries provider.enforce_distillable_text; each prompt is asked with its recipe
    (at the simulator), its row names it, the manifest lists the mixture, the summary and report count
    kept tokens per recipe, the export filters by it; a rerun into a fresh folder picks the same."""
    fleet.start_simulator("--latency-median-ms", "20")
    rows = prompts(60, "s")
    data = write_jsonl(fleet.tmp / "s.jsonl", rows)
    by_hash = {prompt_hash(r["messages"]): r["id"] for r in rows}
    want: dict[str, dict[str, float]] = {"greedy": {"temperature": 0},
                                         "temperature=0.8,top_p=0.95": {"temperature": 0.8, "top_p": 0.95}}
    fleet.start_worker("w1", concurrency=20)
    seen: list[dict[str, str]] = []
    for name in ("S", "S2"):
        # The rerun: the same file under another name into another folder, so every prompt is asked again.
        out = fleet.out if name == "S" else fleet.tmp / "rerun"
        requests.post(fleet.sim_url + "/_sim/reset", timeout=5).raise_for_status()
        config = fleet.write_config([{"name": name, "path": data, "length": "short", "sampling": _MIXTURE}])
        config.write_text(config.read_text().replace(f'dir = "{fleet.out}"', f'dir = "{out}"'))
        fleet.run_producer(config, name=f"producer-{name}")
        # A request is logged once the simulator closes its answer, which may come after the run's end.
        fleet.wait_for(lambda: len({r["prompt"] for r in fleet.sim_requests() if r["status"] == 200}) == 60, 10,
                       "every prompt's request in the simulator's log")
        sent = [r for r in fleet.sim_requests() if r["status"] == 200]
        assert all(r["params"]["provider"] == {"enforce_distillable_text": True} for r in sent), sent[:3]
        kept = read_rows(out, name)
        assert len(kept) == 60
        recipe_of = {r["id"]: r["sampling"]["recipe"] for r in kept}
        for r in kept:
            assert r["sampling"] == {"recipe": r["sampling"]["recipe"], **want[r["sampling"]["recipe"]]}
        for r in sent:  # what was asked is the row's recipe ([request] temperature = 1.0 under it)
            recipe = recipe_of[by_hash[r["prompt"]]]
            assert {k: r["params"].get(k) for k in ("temperature", "top_p")} == {
                "temperature": want[recipe]["temperature"], "top_p": want[recipe].get("top_p")}, r
        seen.append(recipe_of)
        assert set(recipe_of.values()) == set(want)
    assert seen[0] == seen[1]  # the same recipe for every prompt on the rerun

    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["sampling"]["S"] == {"greedy": {"temperature": 0.0, "share": 0.5}, "temperature=0.8,top_p=0.95": {
        "temperature": 0.8, "top_p": 0.95, "share": 0.5}}
    assert manifest["distillation"]["is_trainable_text"] is True and manifest["distillation"]["read_at"]
    assert manifest["provider"] == {"enforce_distillable_text": True}
    summary = read_summary(fleet.out, "S")
    kept = read_rows(fleet.out, "S")
    per_recipe = {name: sum(r["num_tokens"] for r in kept if r["sampling"]["recipe"] == name) for name in want}
    assert summary["recipe_tokens"] == per_recipe and sum(per_recipe.values()) == summary["tokens"]
    report = (fleet.out / "report.md").read_text()
    assert f"`greedy` {per_recipe['greedy']:,} tokens" in report and "distillation: allowed" in report
    greedy = export(fleet.out, fleet.tmp / "export", recipes=["greedy"])
    assert [s.rows for s in greedy.splits] == [list(seen[0].values()).count("greedy")]
    card = greedy.card.read_text()
    assert "distillation: allowed by the model's author" in card and manifest["distillation"]["read_at"] in card
    with pytest.raises(Exception, match="not a sampling recipe"):
        export(fleet.out, fleet.tmp / "export2", recipes=["hot"])
