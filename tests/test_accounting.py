"""The accounting record (``common/accounting.COUNTERS``): every counter declared there is the one
budget.lua and the workers write, and reaches, under its one name and with its value, the
producer's state, summary.json, the report and the exporter's /metrics."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common import stats
from common.accounting import COUNTERS, USD, Counter
from common.budget import FIELDS, NUSD_PER_USD, TOTALS, Budget
from common.keys import CURRENT_RUN, DatasetKeys
from producer.metrics import make_registry
from producer.report import REPORT_MD, write_report
from producer.state import read_state
from producer.summary import Summary, summary_counts

LUA = Path(__file__).resolve().parent.parent / "common" / "budget.lua"


def _stats_header() -> str:
    """budget.lua's header paragraph for KEYS[11], the stats hash."""
    text = LUA.read_text()
    return text[text.index("-- KEYS[11] stats"):text.index("-- KEYS[12]")]


def test_budget_lua_names_every_counter_field_and_writes_no_other() -> None:
    header = set(re.findall(r"[a-z][a-z_]+", _stats_header()))
    missing = [c.source for c in COUNTERS if c.source not in header]
    assert not missing, f"budget.lua's KEYS[11] header does not list {missing}"
    # A field the script itself writes into the stats hash must be a declared counter.
    written = set(re.findall(r'add\(stats, "([a-z_]+)"', LUA.read_text()))
    sources = {c.source for c in COUNTERS}
    assert written <= sources, f"budget.lua writes {written - sources} into stats, not in COUNTERS"
    # And what the workers hand the script with a billed answer.
    usage = stats.answer_counts({"prompt_tokens": 1, "completion_tokens": 2, "reasoning_tokens": 0, "cost": 0.1})
    assert set(usage) <= sources


def _expected(i: int, c: Counter) -> tuple[int, int | float]:
    """A distinct raw value per counter, and the value it must arrive as."""
    raw = 1_000 + 37 * i
    return raw, c.value(raw)


def test_every_counter_travels_from_the_hash_to_state_summary_report_and_metrics(
        redis_client: redis.Redis, tmp_path: Path) -> None:
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


def test_every_budget_total_goes_by_the_names_budget_py_declares(redis_client: redis.Redis) -> None:
    """``common/budget.TOTALS``: each budget total is read from its hash field into the snapshot and
    the producer's state under its one name, and reaches summary.json and /metrics under the
    user-facing names it declares (a rename anywhere without the table fails here)."""
    dataset = "totals"
    k = DatasetKeys(dataset)
    for i, t in enumerate(TOTALS):
        assert t.field in FIELDS, f"{t.field} is not a field of budget.lua's hash"
        redis_client.hset(k.budget, t.field, 1_000_000_000 * (i + 1))  # a distinct value each
    redis_client.set(CURRENT_RUN, json.dumps({"config_id": "cfg", "datasets": [dataset], "started_s": time.time()}))
    snap, st = Budget(redis_client, dataset).snapshot(), read_state(redis_client, dataset)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(make_registry(redis_client)).decode()):
        for s in family.samples:
            if s.labels.get("dataset") == dataset:
                samples[s.name.removesuffix("_total")] = s.value
    summary_keys = {f.name for f in dataclasses.fields(Summary)}
    for i, t in enumerate(TOTALS):
        dollars = t.name.endswith("_usd")
        raw = getattr(snap, t.name.removesuffix("_usd") + "_nusd" if dollars else t.name)
        value = getattr(st, t.name)
        assert raw == 1_000_000_000 * (i + 1), t
        assert value == (raw / NUSD_PER_USD if dollars else raw), t
        assert t.summary is None or t.summary in summary_keys, f"summary.json has no {t.summary}"
        if t.metric is not None:
            assert samples.get(t.metric) == value, f"/metrics: {t.metric} is not {t.name}"
