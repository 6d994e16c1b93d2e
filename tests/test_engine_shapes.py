"""Engine rows from both SGLang answer shapes, checked against SGLang's own source
(``python/sglang/srt/entrypoints/openai/protocol.py``: ``ChatCompletionRequest.return_token_ids`` and
``return_prompt_token_ids``, ``ChatCompletionResponseChoice.prompt_token_ids`` and ``token_ids``) and
the vLLM-like top-level ``prompt_token_ids`` a patched build returns; an engine that answers
without ids halts the run with a line that names the engine and what to upgrade."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from common.errors import MisconfiguredError
from tests.fleet import TEST_KEY, Fleet, read_summary, write_jsonl
from workers.upstreams.upstream import Request
from workers.upstreams.vllm import NO_IDS_FIX, EngineClient

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


def _request() -> Request:
    return Request(model="m", messages=[{"role": "user", "content": "hi"}], tools=None, max_tokens=8,
                   params={}, timeout_s=5)


def test_each_engine_is_asked_for_its_ids_with_its_own_flags() -> None:
    sglang = EngineClient("sglang", "http://engine:30000", None, pool_size=1)._body(_request())
    vllm = EngineClient("vllm", "http://engine:8000", None, pool_size=1)._body(_request())
    assert sglang["return_token_ids"] is True and sglang["return_prompt_token_ids"] is True
    assert vllm["return_token_ids"] is True and "return_prompt_token_ids" not in vllm


@pytest.mark.parametrize(("kind", "body", "choice"), [
    ("sglang", {}, {"prompt_token_ids": [1, 2], "token_ids": [3, 4]}),       # SGLang's own: in the choice
    ("sglang", {"prompt_token_ids": [1, 2]}, {"token_ids": [3, 4]}),         # patched: top level
    ("vllm", {"prompt_token_ids": [1, 2]}, {"token_ids": [3, 4]}),           # vLLM's
    ("vllm", {}, {"prompt_token_ids": [1, 2], "token_ids": [3, 4]}),
])
def test_both_shapes_are_read(kind: str, body: dict[str, Any], choice: dict[str, Any]) -> None:
    client = EngineClient(kind, "http://engine:30000", None, pool_size=1)  # type: ignore[arg-type]
    assert client._extra_fields(body, choice, "m") == {"prompt_ids": [1, 2], "completion_ids": [3, 4],
                                                       "provider": kind}


def test_no_ids_names_the_engine_and_the_fix() -> None:
    client = EngineClient("sglang", "http://engine:30000", None, pool_size=1)
    with pytest.raises(MisconfiguredError) as caught:
        client._extra_fields({}, {"token_ids": [3]}, "m")
    message = str(caught.value)
    assert "the sglang server answered without prompt ids" in message
    assert "upgrade SGLang to one whose chat API takes return_prompt_token_ids" in message
    assert caught.value.fix == NO_IDS_FIX["sglang"]  # what the halt line ends with


def test_llama_cpp_is_asked_for_its_tokens_and_its_prompt_at_the_servers_root() -> None:
    """llama-server (tests/test_real_engine.py runs the real one): ``return_tokens`` and ``verbose``
    on the chat route; the prompt's ids from ``/tokenize`` beside ``/v1``, however the URL is written."""
    for url in ("http://engine:8080/v1", "http://engine:8080", "http://engine:8080/v1/chat/completions/"):
        client = EngineClient("llamacpp", url, None, pool_size=1)
        assert (client.url, client.tokenize_url) == ("http://engine:8080/v1/chat/completions",
                                                     "http://engine:8080/tokenize")
    body = client._body(_request())
    assert body["return_tokens"] is True and body["verbose"] is True
    with pytest.raises(MisconfiguredError) as caught:
        client._extra_fields({"__verbose": {"tokens": [], "prompt": "<|im_start|>user"}}, {}, "m")
    assert "the llamacpp server answered without completion ids" in str(caught.value)
    assert caught.value.fix == NO_IDS_FIX["llamacpp"]
    vllm = EngineClient("vllm", "http://engine:8000", None, pool_size=1)
    with pytest.raises(MisconfiguredError, match=r"0\.10\.2"):
        vllm._extra_fields({}, {}, "m")


def _sglang_run(fleet: Fleet, rows: list[dict[str, Any]], name: str) -> Any:
    data = write_jsonl(fleet.tmp / f"{name}.jsonl", rows)
    config = fleet.write_config([{"name": name, "path": data, "length": "short"}], max_attempts=3, timeout_s=60)
    config.write_text(config.read_text().replace("[model]\n", '[model]\nupstream = "sglang"\n', 1))
    return config


def _sim(spec: dict[str, Any], tag: str) -> dict[str, Any]:
    return {"id": tag, "messages": [{"role": "user", "content": f"#sim {json.dumps(spec)} {tag}"}]}


@pytest.mark.fleet
def test_an_sglang_run_keeps_the_engines_ids_from_both_shapes(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    rows = [_sim({"ids_shape": "sglang" if i % 2 else "vllm", "content": f"Answer {i}.", "reasoning": "r"},
                 f"s{i}") for i in range(12)]
    fleet.start_worker("w1", concurrency=10, OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=fleet.sim_url + "/api/v1",
                       SPECFLEET_ENGINE_API_KEY=TEST_KEY)
    fleet.run_producer(_sglang_run(fleet, rows, "S"))
    kept = fleet.assert_exactly_once(redis_client, "S", len(rows))
    assert all(r["engine_check"]["match"] and r["engine_check"]["prompt_match"] for r in kept)
    summary = read_summary(fleet.out, "S")
    assert (summary["engine_rows"], summary["failed"]) == (len(rows), 0)


@pytest.mark.fleet
def test_an_sglang_without_ids_halts_the_run_naming_the_engine(fleet: Fleet) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    rows = [_sim({"ids_shape": "none", "content": f"Answer {i}."}, f"n{i}") for i in range(6)]
    fleet.start_worker("w1", concurrency=2, OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=fleet.sim_url + "/api/v1",
                       SPECFLEET_ENGINE_API_KEY=TEST_KEY)
    proc = fleet.start_producer(_sglang_run(fleet, rows, "N"))
    assert proc.wait(timeout=300) == 3, fleet.all_logs()
    out = fleet.log("producer")
    assert "the sglang server answered without prompt ids and completion ids" in out, out[-3000:]
    assert "upgrade SGLang to one whose chat API takes return_prompt_token_ids" in out, out[-3000:]
