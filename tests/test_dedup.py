"""Each distinct prompt asked once, and eval sets kept out, before paying (common/prompt_filter.py):
the reader's verdicts (every read of a dataset the same, the plan's the run's), and a run on the
real fleet: two datasets overlapping by 20% with a worker SIGKILLed mid-run, an eval set's prompts."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import RunConfig
from common.datasets import ReadStats
from common.decontam import EvalIndex, EvalItem, prompt_words
from common.dedup import FingerprintIndex, fingerprint
from common.prompt_filter import RunFilter
from producer.export import export
from producer.share import write_shared
from simulator.seeding import prompt_hash
from tests.chaos import read_shards
from tests.fleet import Fleet, prompts, read_summary, write_jsonl


def _user(text: str, pid: str) -> dict[str, Any]:
    return {"id": pid, "messages": [{"role": "user", "content": text}]}


def _cfg(tmp: Path, datasets: dict[str, list[dict[str, Any]]], **run: Any) -> RunConfig:
    entries = []
    for name, rows in datasets.items():
        path = write_jsonl(tmp / f"{name}.jsonl", rows)
        entries.append({"name": name, "path": path})
    return RunConfig.model_validate({"model": {"name": "m", "tokenizer": "t"}, "run": run, "datasets": entries})


def _ids(filt: RunFilter, cfg: RunConfig, name: str) -> tuple[list[str], ReadStats]:
    stats = ReadStats()
    ds = next(d for d in cfg.datasets if d.name == name)
    return [p.id for p in filt.read(ds, [], stats)], stats


def test_the_normalised_form_is_the_key() -> None:
    same = fingerprint([{"role": "user", "content": "Caf\u00e9  au\n lait "}], None)
    assert fingerprint([{"role": "user", "content": "Cafe\u0301 au lait"}], None) == same  # NFC, spaces
    assert fingerprint([{"role": "user", "content": "Café au lait!"}], None) != same
    assert fingerprint([{"role": "system", "content": "x"}, {"role": "user", "content": "Café au lait"}], None) != same
    assert fingerprint([{"role": "user", "content": "Café au lait"}], [{"type": "function",
                                                                     "function": {"name": "f"}}]) != same
    index = FingerprintIndex()
    fps = [fingerprint([{"role": "user", "content": f"q{i}"}], None) for i in range(5000)]
    assert all(index.add(fp, i % 3) is None for i, fp in enumerate(fps))
    assert [index.owner(fp) for fp in fps] == [i % 3 for i in range(5000)]
    assert index.add(fps[0], 2) == 0  # the first owner is kept


def test_duplicates_across_and_within_datasets_every_read_the_same(tmp_path: Path) -> None:
    a = [_user(f"question {i}", f"a{i}") for i in range(10)]
    b = [_user(f"question  {i} ", f"b{i}") for i in range(8, 14)] + [_user("question 12", "b-again")]
    cfg = _cfg(tmp_path, {"A": a, "B": b})
    filt = RunFilter(cfg)
    assert filt.duplicates == "share"  # the default
    # B read first (a sweep's read of B before A's was ever read to its end): A is indexed for it.
    ids_b, stats_b = _ids(filt, cfg, "B")
    assert ids_b == ["b10", "b11", "b12", "b13"]
    assert (stats_b.prompts, stats_b.duplicate_prompts) == (4, 3)  # b8, b9 (A's), b-again (b12's)
    assert _ids(filt, cfg, "A")[0] == [f"a{i}" for i in range(10)]
    assert _ids(filt, cfg, "B")[0] == ids_b  # a second read: the same verdicts
    # The plan's own filter, reading in config order, agrees.
    fresh = RunFilter(cfg)
    assert _ids(fresh, cfg, "A")[0] == [f"a{i}" for i in range(10)]
    assert _ids(fresh, cfg, "B")[0] == ids_b
    skip = _cfg(tmp_path, {"A": a, "B": b}, duplicates="skip")
    assert _ids(RunFilter(skip), skip, "B")[0] == ids_b
    ask = _cfg(tmp_path, {"A": a, "B": b}, duplicates="ask")
    assert _ids(RunFilter(ask), ask, "B")[0] == [r["id"] for r in b]


def test_shared_rows_once_each_and_a_first_copy_never_kept_counted(tmp_path: Path) -> None:
    """shared.jsonl from what the first copies' datasets kept: each duplicate once however often it is
    written (a resumed run writes it again), and a duplicate whose first copy has no kept row (its
    budget stopped first, it failed) counted as not kept, never given another's row."""
    a = [_user(f"question {i}", f"a{i}") for i in range(6)]
    b = [_user(f"question {i}", f"b{i}") for i in range(3, 8)] + [_user("question 7", "b-again")]
    cfg = _cfg(tmp_path, {"A": a, "B": b})
    filt = RunFilter(cfg)
    kept = {"A": [{"id": "a3", "num_tokens": 5}, {"id": "a5", "num_tokens": 7}],  # a4 never kept
            "B": [{"id": "b7", "num_tokens": 9}]}
    folder = tmp_path / "out" / "B"
    folder.mkdir(parents=True)
    for _ in range(2):
        shared = write_shared(folder, filt, cfg.datasets[1], lambda name: iter(kept[name]), chunk=2)
        rows = [json.loads(line) for line in (folder / "shared.jsonl").read_text().splitlines()]
        assert sorted((r["id"], r["duplicate_of"]["dataset"], r["duplicate_of"]["id"], r["num_tokens"])
                      for r in rows) == [("b-again", "B", "b7", 9), ("b3", "A", "a3", 5), ("b5", "A", "a5", 7)]
        assert (shared.prompts, shared.rows, shared.not_kept) == (3, 3, 1)  # b4: a4 was never kept
        assert rows[0]["where"].startswith(str(tmp_path / "B.jsonl:"))


def test_an_eval_runs_words_match_and_name_the_item(tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog near the river bank today"  # 14 words
    words = prompt_words([{"role": "user", "content": text}])
    index = EvalIndex(13)
    index.add(EvalItem("eval.jsonl:3", "e3"), words)
    index.add(EvalItem("eval.jsonl:4", "e4"), ["what", "is", "2+2?"])
    leaked = prompt_words([{"role": "user", "content": "Please: " + " ".join(words[1:]).upper() + " again"}])
    hit = index.match(leaked)
    assert hit is not None and hit[0] == EvalItem("eval.jsonl:3", "e3")
    assert hit[1] == " ".join(words[1:14])
    assert index.match(prompt_words([{"role": "user", "content": " ".join(words[:12]) + " elsewhere"}])) is None
    # An eval prompt shorter than a run matches only itself, not every prompt with its three words.
    assert index.match(["what", "is", "2+2?"])[0].id == "e4"  # type: ignore[index]
    assert index.match(["so", "what", "is", "2+2?"]) is None


def _rows_by_id(out: Path, name: str) -> dict[str, list[dict[str, Any]]]:
    rows, torn = read_shards(out, name)
    assert torn == 0
    shared = out / name / "shared.jsonl"
    if shared.exists():
        rows += [json.loads(line) for line in shared.read_text().splitlines()]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    return by_id


@pytest.mark.fleet
@pytest.mark.long
def test_two_overlapping_datasets_ask_each_prompt_once_through_a_worker_kill(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """A and B of 100 prompts each, B's first 20 A's last 20 (other ids, other whitespace), and B
    repeats one of its own: every prompt asked once at the simulator though a worker is SIGKILLed
    with requests in flight; A's rows in its shards, B's 80 asked in its shards and its 21 duplicates
    in shared.jsonl, each once, marked ``duplicate_of``; A's budget paid for the shared ones."""
    fleet.start_simulator("--latency-median-ms", "800")
    a_rows = prompts(100, "a")
    b_rows = [{"id": f"b-dup{i}", "messages": [{"role": "user", "content": "  " + r["messages"][0]["content"]}]}
              for i, r in enumerate(a_rows[80:])] + prompts(80, "b")
    b_rows = [{**r, "messages": [{"role": "user", "content": r["messages"][0]["content"] + " (b)"}]}
              if not r["id"].startswith("b-dup") else r for r in b_rows]
    b_rows.append({"id": "b-self", "messages": b_rows[30]["messages"]})  # within B
    a = write_jsonl(fleet.tmp / "a.jsonl", a_rows)
    b = write_jsonl(fleet.tmp / "b.jsonl", b_rows)
    config = fleet.write_config([{"name": "A", "path": a, "length": "short"},
                                 {"name": "B", "path": b, "length": "short"}], timeout_s=5, duplicates=None)
    victim = fleet.start_worker("victim", concurrency=40)
    fleet.start_worker("survivor", concurrency=40)
    producer = fleet.start_producer(config)  # its log: the plan's table and lines, then the run's
    fleet.wait_rows(redis_client, "A", 15)
    assert int(redis_client.hlen("specfleet:ds:A:leases")) > 0
    killed_s = time.time()
    victim.send_signal(signal.SIGKILL)  # mid-run, with requests in flight
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()
    log = fleet.log("producer")
    assert "B: saved 21 of 101 prompts" in log and "saved: 21 duplicate prompts not asked" in log, log[-3000:]

    answered = [r for r in fleet.sim_requests() if r["status"] == 200]
    asked = {r["prompt"] for r in answered}
    # Each distinct prompt once: A's 100 and B's own 80, none of B's 21 duplicates (their text differs
    # in whitespace, so the simulator would count them apart). A prompt answered twice is one the
    # killed worker had in flight (its lease lapsed, as with any SIGKILL): never a duplicate's.
    assert len(asked) == 100 + 80
    first_s: dict[str, float] = {}
    for r in sorted(answered, key=lambda r: r["start_s"]):
        if r["prompt"] in first_s:
            # The victim's last requests may reach the simulator (its start_s) just after the
            # SIGKILL: already on the wire. A re-ask of a lost one comes a lease (> 5 s) later.
            assert first_s[r["prompt"]] < killed_s + 2.0, "a prompt asked twice, not by the killed worker's loss"
        first_s.setdefault(r["prompt"], r["start_s"])
    a_by_id, b_by_id = _rows_by_id(fleet.out, "A"), _rows_by_id(fleet.out, "B")
    assert sorted(a_by_id) == sorted(r["id"] for r in a_rows)
    assert sorted(b_by_id) == sorted(r["id"] for r in b_rows)
    assert all(len(rows) == 1 for rows in (*a_by_id.values(), *b_by_id.values())), "a row twice"
    shared = {i: rows[0] for i, rows in b_by_id.items() if "duplicate_of" in rows[0]}
    assert sorted(shared) == sorted([f"b-dup{i}" for i in range(20)] + ["b-self"])
    for i in range(20):
        row, first = shared[f"b-dup{i}"], a_by_id[f"a{80 + i:05d}"][0]
        assert row["duplicate_of"] == {"dataset": "A", "id": first["id"]}
        assert row["num_tokens"] == first["num_tokens"] and row["generation_id"] == first["generation_id"]
    assert shared["b-self"]["duplicate_of"] == {"dataset": "B", "id": b_rows[30]["id"]}
    sa, sb = read_summary(fleet.out, "A"), read_summary(fleet.out, "B")
    assert (sa["prompts"], sa["results"], sa["duplicate_prompts"]) == (100, 100, 0)
    assert (sb["prompts"], sb["results"], sb["duplicate_prompts"]) == (80, 80, 21)
    assert (sb["shared_prompts"], sb["shared_rows"], sb["shared_not_kept"]) == (21, 21, 0)
    # The first copy's budget pays: B's kept tokens are its own 80 rows', none of the shared ones.
    assert sb["tokens"] == sum(rows[0]["num_tokens"] for i, rows in b_by_id.items() if i not in shared)
    assert sa["tokens"] == sum(rows[0]["num_tokens"] for rows in a_by_id.values())
    manifest = json.loads((fleet.out / "manifest.json").read_text())
    assert manifest["duplicates_policy"] == "share"
    # The export's B split is every B prompt's row, its own and the shared ones.
    rows_of = {s.name: s.rows for s in export(fleet.out, fleet.tmp / "export").splits}
    assert (rows_of["A"], rows_of["B"]) == (100, 101), rows_of
    assert manifest["datasets"]["B"]["duplicate_prompts"] == 21 and manifest["datasets"]["B"]["shared_rows"] == 21


@pytest.mark.fleet
def test_an_eval_sets_prompts_never_reach_the_upstream(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20")
    story = "write a short story about a lighthouse keeper who finds a message in a bottle from the future"
    rows = prompts(30, "d")
    rows[4] = _user(f"Please {story.upper()}, in French.", "leak-story")
    rows[9] = _user("What is 2 + 2 ?", "leak-short")
    rows[11] = _user(" ".join(story.split()[:12]) + " from the past", "near-miss")  # 12 words: not a run
    data = write_jsonl(fleet.tmp / "d.jsonl", rows)
    (fleet.tmp / "evals").mkdir()
    write_jsonl(fleet.tmp / "evals" / "bench.jsonl", [_user(story, "e-story"), _user("unrelated", "e-x")])
    write_jsonl(fleet.tmp / "evals" / "short.jsonl", [{"id": "e-sum", "conversations": [
        {"from": "human", "value": "what is 2 + 2 ?"}]}])
    config = fleet.write_config([{"name": "D", "path": data, "length": "short"}],
                                run=f'exclude = ["{fleet.tmp}/evals/*.jsonl"]')
    fleet.start_worker("w1", concurrency=20)
    log = fleet.run_producer(config)
    assert "D: 2 prompts share a run of words with an eval set" in log, log[-3000:]
    asked = {r["prompt"] for r in fleet.sim_requests()}
    assert prompt_hash(rows[4]["messages"]) not in asked and prompt_hash(rows[9]["messages"]) not in asked
    assert prompt_hash(rows[11]["messages"]) in asked and len(asked) == 28
    excluded = [json.loads(line) for line in (fleet.out / "D" / "excluded.jsonl").read_text().splitlines()]
    assert [(x["id"], x["matched"]["id"]) for x in excluded] == [("leak-story", "e-story"), ("leak-short", "e-sum")]
    assert excluded[0]["matched"]["where"] == f"{fleet.tmp}/evals/bench.jsonl:1"
    assert excluded[1]["matched"]["where"] == f"{fleet.tmp}/evals/short.jsonl:1"
    summary = read_summary(fleet.out, "D")
    assert (summary["prompts"], summary["results"], summary["excluded"]) == (28, 28, 2)
    assert json.loads((fleet.out / "manifest.json").read_text())["datasets"]["D"]["excluded"] == 2
