"""The accounting record (``common/accounting.COUNTERS``): every counter declared there is the one
budget.lua and the workers write, and reaches, under its one name and with its value, the
producer's state, summary.json, the report and the exporter's /metrics; a counter added to the
record and written by one line of budget.lua does, with no other edit. The budget's totals
(``common/budget.BudgetSnapshot``) are read and named from their one declaration."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common import stats
from common.accounting import COUNTERS, PER_ANSWER, USD, Counter
from common.budget import FIELDS, NUSD_PER_USD, Ask, Budget, BudgetSnapshot
from common.contract import Usage
from common.keys import CURRENT_RUN, DatasetKeys
from producer.metrics import make_registry
from producer.report import REPORT_MD, write_report
from producer.state import read_state
from producer.summary import Summary, summary_counts

REPO = Path(__file__).resolve().parent.parent
LUA = REPO / "common" / "budget.lua"


def _written_by_the_script(lua: str) -> set[str]:
    return set(re.findall(r'add\(stats, "([a-z_]+)"', lua))


def check_the_script_writes_declared_counters_only(lua: str) -> None:
    sources = {c.source for c in COUNTERS}
    written = _written_by_the_script(lua)
    assert written <= sources, f"budget.lua writes {written - sources} into stats, not in COUNTERS"
    # And what the workers hand the script with a billed answer: each counter with ``usage`` names a
    # key of ``Usage``, and its increment is that key's value.
    keys = set(Usage.__annotations__)
    for c in COUNTERS:
        assert c.usage in (None, PER_ANSWER) or c.usage in keys, f"{c.name}: Usage has no {c.usage}"
    billed = {"prompt_tokens": 11, "completion_tokens": 22, "reasoning_tokens": 3, "cost": 0.25, "truncated": 1}
    assert stats.answer_counts(billed) == {  # type: ignore[arg-type]
        c.source: 1 if c.usage == PER_ANSWER else c.raw(billed[c.usage]) for c in COUNTERS if c.usage}


def test_budget_lua_writes_only_declared_counters() -> None:
    check_the_script_writes_declared_counters_only(LUA.read_text())


def _expected(i: int, c: Counter) -> tuple[int, int | float]:
    """A distinct raw value per counter, and the value it must arrive as."""
    raw = 1_000 + 37 * i
    return raw, c.value(raw)


def test_every_counter_travels_from_the_hash_to_state_summary_report_and_metrics(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    check_every_counter_travels(redis_client, tmp_path)


def check_every_counter_travels(redis_client: redis.Redis, tmp_path: Path) -> None:
    dataset = "acct"
    k = DatasetKeys(dataset)
    expected = {}
    for i, c in enumerate(COUNTERS):
        raw, value = _expected(i, c)
        redis_client.hset(k.stats, c.source, raw)  # as budget.lua's HINCRBY or a worker's leaves it
        expected[c.name] = value
    redis_client.set(CURRENT_RUN, json.dumps({"config_id": "cfg", "datasets": [dataset], "started_s": time.time(),
                                              "out_dir": str(tmp_path)}))

    st = read_state(redis_client, dataset)
    assert st.counts() == expected
    assert {n: st.to_json()[n] for n in expected} == expected  # the timeline samples

    summary = Summary(dataset=dataset, end_reason="budget", prompts=10, results=5, results_this_run=5, failed=0,
                      skipped=5, malformed=0, tokens=100, budget_tokens=200, **summary_counts(st))
    written = json.loads(summary.dumps())
    for name, value in expected.items():
        assert name in written, f"summary.json lacks {name}"
        assert written[name] == value, name
    assert Summary.from_json(written).counts() == expected

    md = (write_report(tmp_path, [written], {})).read_text()
    assert (tmp_path / REPORT_MD).exists()
    for c in COUNTERS:
        value = expected[c.name]
        shown = f"{value:.6f}" if c.unit == USD else f"{int(value):,}"
        assert f"`{c.name}` {shown}" in md, f"the report does not show {c.name}"

    samples = {}
    for family in text_string_to_metric_families(generate_latest(make_registry(redis_client)).decode()):
        for s in family.samples:
            if s.labels.get("dataset") == dataset:
                samples[s.name] = s.value
    for name, value in expected.items():
        metric = f"specfleet_{name}_total"
        assert metric in samples, f"/metrics lacks {metric}"
        assert samples[metric] == value, metric


def test_every_budget_total_is_read_and_named_from_its_declaration(redis_client: redis.Redis) -> None:
    """``common/budget.BudgetSnapshot``: each total is read from the hash field it declares into the
    snapshot, and reaches the producer's state and /metrics under the name it declares for them."""
    dataset = "totals"
    k = DatasetKeys(dataset)
    totals = [f for f in dataclasses.fields(BudgetSnapshot) if f.metadata["hash"] == "budget" and f.type == "int"]
    for i, f in enumerate(totals):
        assert f.metadata["field"] in FIELDS, f"{f.metadata['field']} is not a field of budget.lua's hash"
        redis_client.hset(k.budget, f.metadata["field"], 1_000_000_000 * (i + 1))  # a distinct value each
    # The words too, each where the snapshot declares it is read from (a distinct word each; no
    # field is named here: tests/test_budget_owner.py).
    words = [f for f in dataclasses.fields(BudgetSnapshot) if f.metadata["hash"] == "budget" and f.type == "str"]
    assert len(words) >= 3  # the rule, the admission state, what ended it
    redis_client.hset(k.budget, mapping={f.metadata["field"]: f"word{i}" for i, f in enumerate(words)})
    redis_client.hset(k.leases, mapping={"a": "x", "b": "y"})
    redis_client.set(CURRENT_RUN, json.dumps({"config_id": "cfg", "datasets": [dataset], "started_s": time.time()}))
    snap, st = Budget(redis_client, dataset).snapshot(), read_state(redis_client, dataset)
    assert (snap.in_flight, st.in_flight) == (2, 2)
    for i, f in enumerate(words):
        assert getattr(snap, f.name) == f"word{i}", f.name
        assert getattr(st, f.metadata["state"] or f.name) == f"word{i}", f.name
    samples = {}
    for family in text_string_to_metric_families(generate_latest(make_registry(redis_client)).decode()):
        for s in family.samples:
            if s.labels.get("dataset") == dataset:
                samples[s.name.removesuffix("_total")] = s.value
    for i, f in enumerate(totals):
        raw = getattr(snap, f.name)
        assert raw == 1_000_000_000 * (i + 1), f.name
        if f.metadata["state"] is None:
            assert not hasattr(st, f.name), f.name  # declared absent from the state: it is
            continue
        dollars = f.name.endswith("_nusd")
        name = f.metadata["state"] or (f.name.removesuffix("_nusd") + "_usd" if dollars else f.name)
        value = getattr(st, name)
        assert value == (raw / NUSD_PER_USD if dollars else raw), f.name
        if f"specfleet_{name}" in samples:
            assert samples[f"specfleet_{name}"] == value, name
    assert {f"specfleet_{n}" for n in ("kept_tokens", "rows", "spent_usd", "reserved_tokens", "held_usd",
                                       "budget_usd")} <= set(samples)


#: The throwaway counter of the two-edit test: its record entry, and budget.lua's line that writes it
#: (in settle, where a landed answer finds no room under the hard cap).
NEW_COUNTER = '    Counter("discarded_over_cap", "over_cap", COUNT, "Billed answers the hard cap had no room for"),\n'
NEW_LUA_LINE = '    add(stats, "over_cap", 1)\n'
_LUA_ANCHOR = '    redis.call("HSET", failed, id, cjson.encode({reason = "over_budget"'


def test_a_counter_is_its_record_entry_plus_the_line_that_writes_it(redis_client: redis.Redis,
                                                                    tmp_path: Path) -> None:
    """The promise of common/accounting.py, kept by trying it: a copy of ``common`` with one
    ``Counter(...)`` line added to the record and one ``add(stats, …)`` line to budget.lua, nothing
    else, and the new counter is counted by a real settle and reaches the producer's state,
    summary.json, the report and /metrics, like every other counter."""
    copy = tmp_path / "src"
    shutil.copytree(REPO / "common", copy / "common", ignore=shutil.ignore_patterns("__pycache__"))
    record = copy / "common" / "accounting.py"
    text = record.read_text()
    anchor = "COUNTERS: tuple[Counter, ...] = (\n"
    assert text.count(anchor) == 1
    record.write_text(text.replace(anchor, anchor + NEW_COUNTER))
    lua = copy / "common" / "budget.lua"
    text = lua.read_text()
    assert text.count(_LUA_ANCHOR) == 1
    lua.write_text(text.replace(_LUA_ANCHOR, NEW_LUA_LINE + _LUA_ANCHOR))
    url = "redis://{host}:{port}/0".format(**redis_client.connection_pool.connection_kwargs)
    code = f"import tests.test_accounting as t; t.check_a_new_counter({url!r}, {str(tmp_path / 'out')!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def check_a_new_counter(url: str, out: str) -> None:
    """In the copy: the new counter is declared, counted by budget.lua and travels."""
    import common
    from common.accounting import BY_NAME

    assert str(REPO) not in common.__file__, common.__file__
    assert BY_NAME["discarded_over_cap"].source == "over_cap"
    check_the_script_writes_declared_counters_only(Path(common.__file__).with_name("budget.lua").read_text())
    client = redis.Redis.from_url(url)
    budget = Budget(client, "cap")
    budget.open(100)
    assert budget.reserve("p1", "l1", ttl_ms=60_000, ask=Ask(100, 0, 100)).status == "ok"
    assert budget.settle("p1", "l1", 150, b"row", cost_usd=0.0) == "discarded"  # 150 tokens: over the cap
    assert stats.DatasetStats(client, "cap").read().discarded_over_cap == 1
    client.delete(*client.keys("*"))
    Path(out).mkdir()
    check_every_counter_travels(client, Path(out))
