"""The OpenRouter simulator over real HTTP: answer shapes, determinism, faults, scripts, billing.

One server per module, on a free port in a background thread; every test starts from a reset
(counters, attempt counts and settings back to the module's baseline: no latency).
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from simulator import SimHandle, SimSettings, predict, start_in_thread
from simulator import server as server_module
from simulator.__main__ import settings_from_args
from simulator.kimi import render_prompt
from simulator.seeding import rng_for
from simulator.settings import SettingsError
from simulator.text import generate_text
from simulator.tokens import SimpleCounter

KEY = "sk-or-v1-simulator-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASELINE = SimSettings(port=0, latency_median_ms=0, error_latency_ms=0, hang_s=0.3,
                    generation_delay_s=0.3, keepalive_s=0.05)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }},
}}
TOOL_SECTION = re.compile(
    r"<\|tool_calls_section_begin\|>(?:<\|tool_call_begin\|>(functions\.\w+:\d+)"
    r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>)+<\|tool_calls_section_end\|>",
    re.S,
)
COUNT = SimpleCounter().count


@pytest.fixture(scope="module")
def server() -> Iterator[SimHandle]:
    with start_in_thread(BASELINE) as handle:
        yield handle


@pytest.fixture
def sim(server: SimHandle) -> SimHandle:
    server.reset()
    return server


def body(text: str = "Tell me about Paris", **extra: Any) -> dict[str, Any]:
    return {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": text}],
            **extra}


def chat(sim: SimHandle, payload: dict[str, Any], **kwargs: Any) -> requests.Response:
    kwargs.setdefault("headers", AUTH)
    kwargs.setdefault("timeout", 10)
    return requests.post(sim.api_base + "/chat/completions", json=payload, **kwargs)


def message(resp: requests.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["choices"][0]["message"]
    return result


def script(spec: dict[str, Any], tail: str = "") -> dict[str, Any]:
    return body("#sim " + json.dumps(spec) + tail)


# --- answers ------------------------------------------------------------------------------------


def test_answer_has_openrouter_shape_and_usage_adds_up(sim: SimHandle) -> None:
    resp = chat(sim, body(max_tokens=8192))
    assert resp.status_code == 200
    data = resp.json()
    assert data["id"].startswith("gen-") and resp.headers["X-Generation-Id"] == data["id"]
    assert data["object"] == "chat.completion" and data["model"] == "moonshotai/kimi-k2.5"
    assert data["provider"] in BASELINE.providers
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["native_finish_reason"] == "stop"
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] and msg["reasoning"]
    usage = data["usage"]
    # The default rule: reasoning + </think> + content + <|im_end|>, the client's own rebuild.
    assert usage["completion_tokens"] == COUNT(msg["reasoning"]) + 1 + COUNT(msg["content"]) + 1
    assert usage["completion_tokens_details"]["reasoning_tokens"] == COUNT(msg["reasoning"])
    assert usage["prompt_tokens"] == COUNT(render_prompt(body()["messages"], []))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    expected_cost = (usage["prompt_tokens"] * 0.60 + usage["completion_tokens"] * 2.50) / 1e6
    assert usage["cost"] == pytest.approx(expected_cost)


def test_same_prompt_same_answer_in_another_process(sim: SimHandle) -> None:
    payload = body("Deterministic, please", max_tokens=8192)
    first, second = message(chat(sim, payload)), message(chat(sim, payload))
    assert first == second  # a retry gets the answer its first attempt had
    assert message(chat(sim, body("Another prompt", max_tokens=8192))) != first
    code = ("import json, sys; from simulator import predict, SimSettings; "
            "print(json.dumps(predict(json.loads(sys.argv[1]), SimSettings())['message']))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert json.loads(out.stdout) == first


def test_generated_text_holds_exact_token_counts_and_mixed_scripts() -> None:
    texts = [generate_text(rng_for(0, f"p{i}", "t"), n) for i, n in enumerate(range(1, 400, 7))]
    assert [COUNT(t) for t in texts] == list(range(1, 400, 7))
    joined = "".join(texts)
    assert any(ord(c) > 127 and c.isalpha() for c in joined)  # non-ASCII words
    assert any(ord(c) >= 0x2700 for c in joined)  # emoji


def test_reasoning_that_eats_max_tokens_gives_null_content_and_length(sim: SimHandle) -> None:
    data = chat(sim, body(max_tokens=20)).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert COUNT(choice["message"]["reasoning"]) == 20
    assert data["usage"]["completion_tokens"] == 20
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == 20


def test_content_cut_by_max_tokens(sim: SimHandle) -> None:
    sim.configure(length_classes={"short": {"reasoning_mean": 5, "reasoning_sd": 0,
                                            "content_mean": 500, "content_sd": 0}})
    data = chat(sim, body(max_tokens=100)).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert COUNT(choice["message"]["reasoning"]) == 5 and COUNT(choice["message"]["content"]) == 94
    assert data["usage"]["completion_tokens"] == 100  # 5 + </think> + 94, no end-of-turn token


def test_length_class_follows_max_tokens(sim: SimHandle) -> None:
    sim.configure(length_classes={
        "short": {"min_max_tokens": 0, "reasoning_mean": 10, "reasoning_sd": 0,
                  "content_mean": 10, "content_sd": 0},
        "long": {"min_max_tokens": 16384, "reasoning_mean": 50, "reasoning_sd": 0,
                 "content_mean": 40, "content_sd": 0},
    })
    short = chat(sim, body(max_tokens=8192)).json()["usage"]
    long = chat(sim, body(max_tokens=32768)).json()["usage"]
    assert short["completion_tokens_details"]["reasoning_tokens"] == 10
    assert long["completion_tokens_details"]["reasoning_tokens"] == 50
    assert long["completion_tokens"] == 50 + 1 + 40 + 1


def test_reasoning_switches_and_field_names(sim: SimHandle) -> None:
    hidden = chat(sim, body(reasoning={"exclude": True})).json()
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0  # still billed
    for off in ({"enabled": False}, {"effort": "none"}):
        data = chat(sim, body(reasoning=off)).json()
        assert data["choices"][0]["message"]["reasoning"] is None
        assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    capped = chat(sim, body("cap", reasoning={"max_tokens": 12})).json()
    assert capped["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    assert capped["choices"][0]["finish_reason"] == "stop"  # a reasoning cap is not a length stop
    low = chat(sim, body("effort", reasoning={"effort": "low"})).json()["usage"]
    high = chat(sim, body("effort", reasoning={"effort": "high"})).json()["usage"]
    assert low["completion_tokens_details"]["reasoning_tokens"] < \
        high["completion_tokens_details"]["reasoning_tokens"]
    sim.configure(reasoning_field="reasoning_content")
    msg = message(chat(sim, body()))
    assert "reasoning" not in msg and msg["reasoning_content"]
    sim.configure(reasoning_field="details")
    msg = message(chat(sim, body()))
    assert "reasoning" not in msg and "reasoning_content" not in msg
    assert msg["reasoning_details"][0]["type"] == "reasoning.text"
    assert msg["reasoning_details"][0]["text"]


def test_structured_tool_calls_when_tools_are_sent(sim: SimHandle) -> None:
    sim.configure(tool_call_rate=1.0)
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0",
         "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "5 C"},
        {"role": "user", "content": "and in Lima?"},
    ]
    for messages, first_idx in (([{"role": "user", "content": "weather?"}], 0), (history, 1)):
        data = chat(sim, {"messages": messages, "tools": [WEATHER_TOOL]}).json()
        choice = data["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] in ("", None)
        call = msg["tool_calls"][0]
        assert call["id"] == f"functions.get_weather:{first_idx}" and call["type"] == "function"
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args["city"], str) and args["unit"] in ("C", "F")
        assert 1 <= args.get("days", 1) <= 7
    data = chat(sim, {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL],
                      "tool_choice": "none"}).json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in data["choices"][0]["message"]


def test_raw_tool_call_text_when_tools_are_only_declared_in_the_prompt(sim: SimHandle) -> None:
    system = {"role": "system", "content": "You can call these tools: " + json.dumps([WEATHER_TOOL])}
    payload = {"messages": [system, {"role": "user", "content": "weather in Kraków?"}]}
    sim.configure(raw_tool_text_rate=1.0)
    msg = message(chat(sim, payload))
    match = TOOL_SECTION.search(msg["content"])
    assert match, msg["content"]
    assert match.group(1) == "functions.get_weather:0"
    assert "city" in json.loads(match.group(2))
    assert "tool_calls" not in msg
    sim.configure(raw_tool_text_rate=0.0)
    assert "<|tool_calls_section_begin|>" not in message(chat(sim, payload))["content"]


# --- faults -------------------------------------------------------------------------------------

HTTP_FAULTS = [("429", 429, "1"), ("502", 502, None), ("503", 503, "1"), ("408", 408, None),
               ("402", 402, None), ("402_retry", 402, "1"), ("400", 400, None),
               ("401", 401, None), ("403", 403, None)]


@pytest.mark.parametrize(("fault", "status", "retry_after"), HTTP_FAULTS)
def test_http_fault_switch(sim: SimHandle, fault: str, status: int, retry_after: str | None) -> None:
    sim.configure(rates={fault: 1.0})
    resp = chat(sim, body())
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == status
    assert resp.headers.get("Retry-After") == retry_after
    if fault == "402_retry":
        assert resp.json()["error"]["metadata"]["limit_source"] == "openrouter_in_flight_budget"
    stats = sim.stats()
    assert stats["faults"] == {fault: 1} and stats["by_status"] == {str(status): 1}
    assert stats["billed_requests"] == 0


def test_retry_after_can_be_switched_off(sim: SimHandle) -> None:
    sim.configure(rates={"429": 1.0}, retry_after_s=None)
    assert "Retry-After" not in chat(sim, body()).headers
    sim.configure(retry_after_s=0.25)
    assert chat(sim, body()).headers["Retry-After"] == "0.25"


def test_hang_holds_then_answers_and_is_billed(sim: SimHandle) -> None:
    sim.configure(rates={"hang": 1.0})
    t0 = time.monotonic()
    resp = chat(sim, body())
    assert time.monotonic() - t0 >= 0.3 and resp.status_code == 200
    assert sim.stats()["billed_requests"] == 1


def test_hang_drop_closes_without_answer_and_is_not_billed(sim: SimHandle) -> None:
    sim.configure(rates={"hang_drop": 1.0})
    t0 = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        chat(sim, body())
    assert time.monotonic() - t0 >= 0.3
    stats = sim.stats()
    assert stats["by_status"] == {"dropped": 1} and stats["billed_requests"] == 0


def test_bad_json_is_a_truncated_200_and_is_billed(sim: SimHandle) -> None:
    sim.configure(rates={"bad_json": 1.0})
    resp = chat(sim, body())
    assert resp.status_code == 200 and resp.headers["X-Generation-Id"].startswith("gen-")
    with pytest.raises(ValueError):
        resp.json()
    assert sim.stats()["billed_requests"] == 1


def test_error_inside_a_200(sim: SimHandle) -> None:
    sim.configure(rates={"error200": 1.0})
    resp = chat(sim, body())
    assert resp.status_code == 200
    data = resp.json()
    assert data["error"]["code"] == 429 and data["error"]["message"] == "Provider returned error"
    assert data["error"]["metadata"] == {"raw": "error code: 1015", "provider_name": data["provider"]}
    choice = data["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    assert data["usage"]["total_tokens"] == 0 and data["usage"]["cost"] == 0
    assert sim.stats()["billed_requests"] == 0


def test_leaked_im_end_is_in_content_but_not_counted_twice(sim: SimHandle) -> None:
    clean = chat(sim, body("leak")).json()
    sim.configure(rates={"leak_im_end": 1.0})
    leaked = chat(sim, body("leak")).json()
    content = leaked["choices"][0]["message"]["content"]
    assert content == clean["choices"][0]["message"]["content"] + "<|im_end|>"
    assert leaked["usage"] == clean["usage"]
    assert sim.stats()["faults"] == {"leak_im_end": 1}


def test_random_faults_are_reproducible_per_prompt_and_attempt(sim: SimHandle) -> None:
    sim.configure(rates={"429": 0.3, "502": 0.2})
    prompts = [body(f"prompt {i}") for i in range(60)]

    def statuses() -> list[int]:
        return [chat(sim, p).status_code for p in prompts for _ in range(2)]

    first = statuses()
    sim.reset()
    sim.configure(rates={"429": 0.3, "502": 0.2})
    assert statuses() == first
    assert 0.3 < sum(s != 200 for s in first) / len(first) < 0.7
    assert {429, 502, 200} == set(first)


def test_config_is_validated_and_names_the_field(sim: SimHandle) -> None:
    for patch, word in (({"nope": 1}, "nope"), ({"rates": {"429": 1.5}}, "rates.429"),
                        ({"rates": {"429": 0.6, "502": 0.6}}, "sum"),
                        ({"rates": {"teapot": 0.1}}, "teapot"), ({"port": 1}, "port"),
                        ({"reasoning_field": "x"}, "reasoning_field"),
                        ({"length_classes": {"short": {"content_mean": -1}}}, "content_mean")):
        resp = requests.post(sim.url + "/_sim/config", json=patch, timeout=5)
        assert resp.status_code == 400 and word in resp.json()["error"]["message"], patch
    shown = requests.get(sim.url + "/_sim/config", timeout=5).json()
    assert shown["rates"] == {} and shown["latency_median_ms"] == 0


# --- scripted answers ---------------------------------------------------------------------------


def test_scripted_answer_is_exact(sim: SimHandle) -> None:
    spec = {"reasoning": "Think: 2+2.", "content": "4 🙂", "finish_reason": "stop",
            "reasoning_field": "reasoning_content", "provider": "Scripted",
            "usage": {"prompt_tokens": 7}}
    data = chat(sim, script(spec)).json()
    msg = data["choices"][0]["message"]
    assert msg["reasoning_content"] == "Think: 2+2." and msg["content"] == "4 🙂"
    assert data["provider"] == "Scripted" and data["usage"]["prompt_tokens"] == 7
    assert data["usage"]["completion_tokens"] == COUNT("Think: 2+2.") + 1 + COUNT("4 🙂") + 1
    assert sim.stats()["scripted"] == 1


def test_scripted_tool_calls_and_raw_text(sim: SimHandle) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": "Zürich"}}]
    data = chat(sim, script({"reasoning": "r", "tool_calls": calls})).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Zürich"}
    raw = message(chat(sim, script({"tool_calls": calls, "raw_tool_text": True, "leak_im_end": True})))
    assert raw["content"] == ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                              '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|>'
                              '<|tool_calls_section_end|><|im_end|>')


def test_fail_attempts_then_the_real_answer(sim: SimHandle) -> None:
    payload = script({"content": "finally", "fail_attempts": [429, 503, "error200", "bad_json"]})
    seen = []
    for _ in range(5):
        resp = chat(sim, payload)
        seen.append(resp.status_code)
    assert seen == [429, 503, 200, 200, 200]
    assert message(resp)["content"] == "finally"
    other = chat(sim, script({"content": "x", "fail_attempts": [429]}, tail=" other prompt"))
    assert other.status_code == 429  # counted per prompt
    stats = sim.stats()
    assert stats["faults"] == {"429": 2, "503": 1, "error200": 1, "bad_json": 1}
    assert stats["billed_requests"] == 2  # bad_json and the answer; errors are free


def test_malformed_script_is_a_400(sim: SimHandle) -> None:
    for bad in ("#sim {not json", '#sim {"contnet": "x"}', '#sim {"fail_attempts": [418]}'):
        resp = chat(sim, body(bad))
        assert resp.status_code == 400 and "#sim" in resp.json()["error"]["message"]


# --- billing, stats, auth ----------------------------------------------------------------------


def test_ledger_counts_what_was_billed(sim: SimHandle) -> None:
    usages = [chat(sim, body(f"bill {i}")).json()["usage"] for i in range(5)]
    sim.configure(rates={"503": 1.0})
    assert chat(sim, body("unbilled")).status_code == 503
    stats = sim.stats(detail=True)
    assert stats["requests"] == 6 and stats["billed_requests"] == 5
    assert stats["by_status"] == {"200": 5, "503": 1}
    for key in ("prompt_tokens", "completion_tokens"):
        assert stats[f"billed_{key}"] == sum(u[key] for u in usages)
    assert stats["billed_reasoning_tokens"] == sum(
        u["completion_tokens_details"]["reasoning_tokens"] for u in usages)
    assert stats["billed_cost_usd"] == pytest.approx(sum(u["cost"] for u in usages))
    assert len(stats["generations"]) == 5 and stats["in_flight"] == 0


def test_client_that_times_out_is_still_billed_in_full(sim: SimHandle) -> None:
    payload = script({"latency_ms": 400}, tail=" slow")
    with pytest.raises(requests.Timeout):
        chat(sim, payload, timeout=0.1)
    deadline = time.monotonic() + 5
    while sim.stats()["billed_requests"] == 0:
        assert time.monotonic() < deadline, "the slow answer was never billed"
        time.sleep(0.05)
    stats = sim.stats(detail=True)
    expected = predict(payload, BASELINE)["usage"]
    assert stats["abandoned_requests"] == 1
    assert stats["billed_completion_tokens"] == expected["completion_tokens"]
    assert stats["generations"][0]["abandoned"] is True


def test_auth_is_required_and_the_key_never_logged(sim: SimHandle,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert chat(sim, body(), headers={}).status_code == 401
    assert chat(sim, body(), headers={"Authorization": "Bearer "}).status_code == 401
    assert chat(sim, body(), headers={"Authorization": KEY}).status_code == 401
    sim.configure(expect_key=KEY)
    wrong = chat(sim, body(), headers={"Authorization": "Bearer sk-or-v1-wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    assert chat(sim, body()).status_code == 200
    assert requests.get(sim.url + "/_sim/config", timeout=5).json()["expect_key"] == "<set>"
    assert sim.stats()["billed_requests"] == 1
    assert "status=401" in caplog.text and "status=200" in caplog.text
    assert KEY not in caplog.text


def test_generation_stats_appear_after_a_delay(sim: SimHandle) -> None:
    resp = chat(sim, body())
    gen_id, usage = resp.headers["X-Generation-Id"], resp.json()["usage"]
    url = sim.api_base + "/generation"
    assert requests.get(url, params={"id": gen_id}, headers=AUTH, timeout=5).status_code == 404
    time.sleep(0.35)
    found = requests.get(url, params={"id": gen_id}, headers=AUTH, timeout=5)
    assert found.status_code == 200, found.text
    stats = found.json()["data"]
    assert stats["id"] == gen_id and stats["total_cost"] == usage["cost"]
    assert stats["native_tokens_completion"] == usage["completion_tokens"]
    assert stats["native_tokens_reasoning"] == usage["completion_tokens_details"]["reasoning_tokens"]
    assert stats["finish_reason"] == "stop" and stats["cancelled"] is False
    assert requests.get(url, params={"id": "gen-nope"}, headers=AUTH, timeout=5).status_code == 404


def test_key_endpoint_and_credit_limit(sim: SimHandle) -> None:
    cost = chat(sim, body()).json()["usage"]["cost"]
    key = requests.get(sim.api_base + "/key", headers=AUTH, timeout=5).json()["data"]
    assert key["usage"] == pytest.approx(cost) and key["limit"] is None
    sim.configure(credit_limit_usd=cost / 2)
    resp = chat(sim, body("over the limit"))
    assert resp.status_code == 402 and "Retry-After" not in resp.headers
    key = requests.get(sim.api_base + "/key", headers=AUTH, timeout=5).json()["data"]
    assert key["limit_remaining"] == 0


# --- models, prices, routes ---------------------------------------------------------------------

PRICE = re.compile(r"^\d+(\.\d+)?$")  # a plain decimal string, never "6e-07"


def published(sim: SimHandle, model: str = "moonshotai/kimi-k2.5") -> dict[str, Any]:
    resp = requests.get(sim.api_base + "/models", timeout=5)  # no key needed, as on OpenRouter
    assert resp.status_code == 200, resp.text
    entry: dict[str, Any] = next(m for m in resp.json()["data"] if m["id"] == model)
    return entry


def priced_cost(pricing: dict[str, str], usage: dict[str, Any]) -> float:
    return (usage["prompt_tokens"] * float(pricing["prompt"])
            + usage["completion_tokens"] * float(pricing["completion"]) + float(pricing["request"]))


def test_models_endpoint_publishes_what_is_billed(sim: SimHandle) -> None:
    model = published(sim)
    assert model["pricing"]["prompt"] == "0.0000006" and model["pricing"]["completion"] == "0.0000025"
    assert model["pricing"]["request"] == "0" and model["pricing"]["internal_reasoning"] == "0"
    assert all(PRICE.match(v) for v in model["pricing"].values()), model["pricing"]
    assert model["context_length"] == 262144 == model["top_provider"]["context_length"]
    assert model["top_provider"]["max_completion_tokens"] == 65536
    assert {"max_tokens", "reasoning", "tools"} <= set(model["supported_parameters"])
    first = chat(sim, body(max_tokens=8192)).json()["usage"]
    assert first["cost"] == pytest.approx(priced_cost(model["pricing"], first), rel=1e-9)
    # Changing the price changes both what is published and what is billed.
    sim.configure(price_in_per_mtok=1.25, price_out_per_mtok=10, price_request_usd=0.001,
                  context_length=100000, max_completion_tokens=None)
    model = published(sim)
    assert model["pricing"]["prompt"] == "0.00000125" and model["pricing"]["completion"] == "0.00001"
    assert model["pricing"]["request"] == "0.001" and model["context_length"] == 100000
    assert model["top_provider"]["max_completion_tokens"] is None
    usage = chat(sim, body("priced again", max_tokens=8192)).json()["usage"]
    assert usage["cost"] == pytest.approx(priced_cost(model["pricing"], usage), rel=1e-9)
    assert usage["cost"] > 0.001  # the per-request price is in it
    assert sim.stats()["billed_cost_usd"] == pytest.approx(first["cost"] + usage["cost"], rel=1e-9)


def test_endpoints_per_provider_and_unknown_model(sim: SimHandle) -> None:
    resp = requests.get(sim.api_base + "/models/moonshotai/kimi-k2.5/endpoints", timeout=5)
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert data["id"] == "moonshotai/kimi-k2.5"
    assert [e["provider_name"] for e in data["endpoints"]] == list(BASELINE.providers)
    model = published(sim)
    for e in data["endpoints"]:
        assert e["pricing"] == model["pricing"] and e["context_length"] == model["context_length"]
        assert e["max_completion_tokens"] == model["top_provider"]["max_completion_tokens"]
    gone = requests.get(sim.api_base + "/models/moonshotai/kimi-k9/endpoints", timeout=5)
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "No endpoints found for moonshotai/kimi-k9."


def test_unknown_model_answers_404_on_every_request(sim: SimHandle) -> None:
    payload = {**body(), "model": "moonshotai/kimi-k9"}
    for _ in range(3):  # not a transient fault: every attempt gets the same answer
        resp = chat(sim, payload)
        assert resp.status_code == 404
        assert resp.json()["error"] == {"code": 404,
                                        "message": "No endpoints found for moonshotai/kimi-k9."}
    stats = sim.stats()
    assert stats["by_status"] == {"404": 3} and stats["billed_requests"] == 0
    # The model and its Batch API variant (simulator/batch.py), with its own pricing.
    assert [m["id"] for m in requests.get(sim.api_base + "/models", timeout=5).json()["data"]] \
        == ["moonshotai/kimi-k2.5", "moonshotai/kimi-k2.5:batch"]
    sim.configure(models=["moonshotai/kimi-k2.5", "moonshotai/kimi-k9"])
    assert chat(sim, payload).status_code == 200
    assert published(sim, "moonshotai/kimi-k9")["pricing"] == published(sim)["pricing"]


def test_base_url_forms_and_wrong_paths(sim: SimHandle) -> None:
    # The OpenAI-SDK base (".../api/v1") plus "/chat/completions" is the same route; so is an
    # engine's "/v1" (vLLM, SGLang, llama.cpp serve there), which the simulator answers alike.
    assert sim.api_base + "/chat/completions" == sim.url + "/api/v1/chat/completions"
    assert chat(sim, body()).status_code == 200
    assert requests.post(sim.url + "/v1/chat/completions", json=body(), headers=AUTH, timeout=5).status_code == 200
    for wrong in ("/api/v1/api/v1/chat/completions", "/chat/completions", "/v1/v1/chat/completions",
                  "/api/v1/models/moonshotai/endpoints"):
        resp = requests.post(sim.url + wrong, json=body(), headers=AUTH, timeout=5)
        assert resp.status_code == 404, wrong
        assert resp.json()["error"]["code"] == 404
    get_models = requests.get(sim.url + "/api/v1/api/v1/models", timeout=5)
    assert get_models.status_code == 404
    assert sim.stats()["requests"] == 2  # wrong paths never reached the chat route


def test_prompt_plus_max_tokens_must_fit_the_context(sim: SimHandle) -> None:
    prompt_tokens = COUNT(render_prompt(body()["messages"], []))
    sim.configure(context_length=prompt_tokens + 100)
    assert chat(sim, body(max_tokens=100)).status_code == 200
    resp = chat(sim, body(max_tokens=101))
    assert resp.status_code == 400
    message_text = resp.json()["error"]["message"]
    assert f"maximum context length is {prompt_tokens + 100} tokens" in message_text
    assert f"({prompt_tokens} of text input, 101 in the output)" in message_text
    assert sim.stats()["billed_requests"] == 1


# --- capacity mode -----------------------------------------------------------------------------


def in_parallel(sim: SimHandle, payloads: list[dict[str, Any]]) -> list[requests.Response]:
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: chat(sim, p), payloads))


def test_capacity_in_flight_answers_429_with_retry_after(sim: SimHandle) -> None:
    # Everyone arrives well within the 2 s the admitted requests hold their slots.
    sim.configure(latency_median_ms=2000, latency_p99_ms=2000, capacity_in_flight=5,
                  capacity_retry_after_s=2)
    resps = in_parallel(sim, [body(f"cap {i}") for i in range(20)])
    ok = [r for r in resps if r.status_code == 200]
    limited = [r for r in resps if r.status_code == 429]
    assert len(ok) == 5 and len(limited) == 15
    for r in limited:
        assert r.headers["Retry-After"] == "2" and r.json()["error"]["code"] == 429
    stats = sim.stats()
    assert stats["capacity_429s"] == 15 == stats["capacity_429s_by_limit"]["in_flight"]
    assert stats["max_admitted_in_flight"] == 5 and stats["admitted_in_flight"] == 0
    assert stats["faults"].get("429", 0) == 0  # not an injected fault
    assert stats["billed_requests"] == len(ok)
    sim.configure(latency_median_ms=0, latency_p99_ms=None)
    assert chat(sim, body("cap after")).status_code == 200  # the slots were given back


def test_capacity_refusal_is_not_an_attempt_of_the_prompt(sim: SimHandle) -> None:
    first_try_503 = script({"fail_attempts": [503]}, tail=" capacity")
    sim.configure(capacity_in_flight=0)
    assert chat(sim, first_try_503).status_code == 429
    sim.configure(capacity_in_flight=None)
    # Still the prompt's first attempt: the seeded faults and answers follow real attempts only.
    assert [chat(sim, first_try_503).status_code for _ in range(2)] == [503, 200]


def test_capacity_per_second(sim: SimHandle) -> None:
    sim.configure(capacity_per_s=3, capacity_retry_after_s=None)
    codes = sorted(r.status_code for r in in_parallel(sim, [body(f"rps {i}") for i in range(6)]))
    assert codes == [200, 200, 200, 429, 429, 429]
    stats = sim.stats()
    assert stats["capacity_429s_by_limit"] == {"in_flight": 0, "per_second": 3}
    assert stats["per_s_window"] == 3
    time.sleep(1.05)  # the window slides past the admitted ones
    refused = chat(sim, body("rps later"))
    assert refused.status_code == 200 and "Retry-After" not in refused.headers


@pytest.mark.parametrize("count_rejected", [False, True])
def test_capacity_per_second_counting_rejected(sim: SimHandle, count_rejected: bool) -> None:
    sim.configure(capacity_per_s=1, capacity_count_rejected=count_rejected)
    t0 = time.monotonic()
    assert chat(sim, body("a")).status_code == 200
    time.sleep(max(0.0, t0 + 0.6 - time.monotonic()))
    assert chat(sim, body("b")).status_code == 429
    time.sleep(max(0.0, t0 + 1.2 - time.monotonic()))
    # "a" has left the window; "b" is in it only when rejected requests count.
    assert chat(sim, body("c")).status_code == (429 if count_rejected else 200)


def test_in_flight_is_readable_live_and_as_a_series(sim: SimHandle) -> None:
    sim.configure(latency_median_ms=1500, latency_p99_ms=1500, capacity_in_flight=3,
                  series_interval_s=0.1)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat, sim, body(f"series {i}")) for i in range(8)]
        deadline = time.monotonic() + 5
        while sim.stats()["requests"] < 8:
            assert time.monotonic() < deadline, "the requests never arrived"
            time.sleep(0.02)
        live = sim.stats()
        codes = sorted(f.result().status_code for f in futures)
    assert live["admitted_in_flight"] == 3  # three answers still on their way
    assert codes == [200] * 3 + [429] * 5
    series = sim.stats()  # the plain stats carry no series
    assert "series" not in series
    data = requests.get(sim.url + "/_sim/stats", params={"series": 1}, timeout=5).json()["series"]
    assert data["interval_s"] == 0.1 and data["columns"][:3] == ["t_s", "in_flight",
                                                                 "admitted_in_flight"]
    rows = data["rows"]
    cols = {name: i for i, name in enumerate(data["columns"])}
    assert [r[0] for r in rows] == pytest.approx([rows[0][0] + 0.1 * i for i in range(len(rows))])
    assert max(r[cols["admitted_in_flight"]] for r in rows) == 3
    assert sum(r[cols["requests"]] for r in rows) == 8
    assert sum(r[cols["capacity_429"]] for r in rows) == 5 == sum(r[cols["status_429"]] for r in rows)
    # The answers took 1.5 s: the series shows three in flight for most of it.
    assert sum(r[cols["admitted_in_flight"]] == 3 for r in rows) >= 12
    later = requests.get(sim.url + "/_sim/stats", params={"series": 1, "since_s": rows[-2][0]},
                         timeout=5).json()["series"]["rows"]
    assert later == rows[-2:]


# --- engine-ids mode (vLLM's return_token_ids) --------------------------------------------------

DEMO_TOKENIZER = Path(__file__).parent.parent / "demo" / "tokenizer"


@pytest.fixture(scope="module")
def engine_server() -> Iterator[SimHandle]:
    with start_in_thread(BASELINE.updated({"tokenizer": str(DEMO_TOKENIZER)},
                                          allow_fixed=True)) as handle:
        yield handle


@pytest.fixture
def engine(engine_server: SimHandle) -> SimHandle:
    engine_server.reset()
    return engine_server


@pytest.fixture(scope="module")
def demo_tok() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))


def decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def with_ids(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "return_token_ids": True}


def test_engine_ids_have_vllms_shape_and_end_with_the_stop_token(engine: SimHandle,
                                                                  demo_tok: Any) -> None:
    plain = chat(engine, script({"reasoning": "Think it over.", "content": "Hello there, world!"}))
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]
    resp = chat(engine, with_ids(script({"reasoning": "Think it over.",
                                         "content": "Hello there, world!",
                                         "noncanonical": False})))
    data = resp.json()
    prompt_ids, ids = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    prompt = decode(demo_tok, prompt_ids)
    # The template rendered with the generation prompt (K2.5 opens <think> in it), tokenized.
    assert prompt.endswith('"noncanonical": false}<|im_end|><|im_assistant|>assistant<|im_middle|><think>')
    assert prompt.count("<|im_user|>user<|im_middle|>#sim ") == 1
    assert prompt_ids == encode(demo_tok, prompt)
    # The sampled turn: reasoning, </think>, content and the end-of-turn token vLLM keeps.
    assert decode(demo_tok, ids) == "Think it over.</think>Hello there, world!<|im_end|>"
    assert ids == encode(demo_tok, decode(demo_tok, ids)) and ids[-1] == demo_tok.token_to_id("<|im_end|>")
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt_ids), len(ids))
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(encode(demo_tok, "Think it over."))
    stats = engine.stats()
    assert stats["engine_id_answers"] == 1 and stats["noncanonical_answers"] == 0
    assert stats["billed_completion_tokens"] == usage["completion_tokens"] + plain.json()["usage"]["completion_tokens"]


def test_engine_ids_on_length_and_tool_calls(engine: SimHandle, demo_tok: Any) -> None:
    cut = chat(engine, with_ids(script({"reasoning": "r", "content": "never ends",
                                        "finish_reason": "length"}))).json()
    assert decode(demo_tok, cut["choices"][0]["token_ids"]) == "r</think>never ends"  # no stop token
    calls = chat(engine, with_ids(script({"reasoning": "r", "content": "",
                                          "tool_calls": [{"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}]}))).json()
    assert calls["choices"][0]["finish_reason"] == "tool_calls"
    assert decode(demo_tok, calls["choices"][0]["token_ids"]) == (
        "r</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
        "<|im_end|>")
    leaked = chat(engine, with_ids(script({"reasoning": "r", "content": "c", "leak_im_end": True}))).json()
    assert leaked["choices"][0]["message"]["content"] == "c<|im_end|>"
    assert decode(demo_tok, leaked["choices"][0]["token_ids"]) == "r</think>c<|im_end|>"  # one stop


def test_noncanonical_tokenization_decodes_to_the_same_text(engine: SimHandle,
                                                            demo_tok: Any) -> None:
    payload = with_ids(script({"reasoning": "Weather thinking.", "content": "Sunshine everywhere.",
                               "noncanonical": True}))
    resp = chat(engine, payload)
    ids = resp.json()["choices"][0]["token_ids"]
    text = decode(demo_tok, ids)
    canonical = encode(demo_tok, text)
    assert text == "Weather thinking.</think>Sunshine everywhere.<|im_end|>"
    assert ids != canonical and len(ids) == len(canonical) + 1
    stats = engine.stats(detail=True)
    assert stats["noncanonical_answers"] == 1
    assert stats["noncanonical_generations"] == [resp.headers["X-Generation-Id"]]
    injected = stats["generations"][0]["noncanonical"]
    p = injected["position"]
    # Exactly one canonical token became two whose strings join to it.
    assert ids[:p] == canonical[:p] and ids[p + 2:] == canonical[p + 1:]
    assert ids[p:p + 2] == injected["ids"] and canonical[p] == injected["canonical_id"]
    assert "".join(injected["tokens"]) == injected["canonical_token"]
    assert resp.json()["usage"]["completion_tokens"] == len(ids)
    # A retry of the prompt samples the same ids.
    assert chat(engine, payload).json()["choices"][0]["token_ids"] == ids


def test_noncanonical_rate_is_counted_per_generation(engine: SimHandle, demo_tok: Any) -> None:
    engine.configure(noncanonical_rate=0.3)
    seen: set[str] = set()
    n = 200
    for i in range(n):
        resp = chat(engine, with_ids(body(f"rate {i}", max_tokens=60)))
        ids = resp.json()["choices"][0]["token_ids"]
        if ids != encode(demo_tok, decode(demo_tok, ids)):
            seen.add(resp.headers["X-Generation-Id"])
    stats = engine.stats(detail=True)
    assert set(stats["noncanonical_generations"]) == seen
    assert stats["noncanonical_answers"] == len(seen) and stats["engine_id_answers"] == n
    assert 30 <= len(seen) <= 90  # 60 expected; binomial sd 6.5
    engine.configure(noncanonical_rate=0.0)
    for i in range(20):
        ids = chat(engine, with_ids(body(f"rate {i}", max_tokens=60))).json()["choices"][0]["token_ids"]
        assert ids == encode(demo_tok, decode(demo_tok, ids))


def test_engine_ids_in_a_stream(engine: SimHandle) -> None:
    payload = with_ids(body("stream my ids", max_tokens=200))
    expected = chat(engine, payload).json()
    _, events = sse_events(chat(engine, {**payload, "stream": True}, stream=True))
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == expected["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    streamed = [i for e in chunks for i in e["choices"][0].get("token_ids", [])]
    assert streamed == expected["choices"][0]["token_ids"]


def test_engine_ids_need_a_tokenizer(sim: SimHandle) -> None:
    resp = chat(sim, with_ids(body()))
    assert resp.status_code == 400 and "--tokenizer" in resp.json()["error"]["message"]
    bad = chat(sim, script({"noncanonical": "yes"}))
    assert bad.status_code == 400 and "noncanonical" in bad.json()["error"]["message"]


# --- streaming ----------------------------------------------------------------------------------


def sse_events(resp: requests.Response) -> tuple[list[str], list[Any]]:
    comments, events = [], []
    # Split on b"\n" only: str.splitlines would also split at U+0085 and friends inside JSON.
    for raw in resp.iter_lines(delimiter=b"\n"):
        line = raw.decode("utf-8")
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return comments, events


def test_stream_rebuilds_the_same_answer(sim: SimHandle) -> None:
    sim.configure(latency_median_ms=120, latency_p99_ms=120)
    payload = body("stream me", stream=True)
    resp = chat(sim, payload, stream=True)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    comments, events = sse_events(resp)
    assert ": OPENROUTER PROCESSING" in comments and len(comments) >= 2
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    deltas = [e["choices"][0] for e in events[:-2]]
    assert deltas[-1]["finish_reason"] == "stop"
    reasoning = "".join(d["delta"].get("reasoning") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    expected = predict({**payload, "stream": False}, BASELINE)
    assert reasoning == expected["message"]["reasoning"]
    assert content == expected["message"]["content"]
    assert usage_chunk["usage"] == expected["usage"]
    assert sim.stats()["billed_completion_tokens"] == expected["usage"]["completion_tokens"]


def test_stream_error_mid_way(sim: SimHandle) -> None:
    sim.configure(rates={"stream_error": 1.0})
    assert chat(sim, body("plain request")).status_code == 200  # needs a stream to fire
    assert sim.stats()["faults"] == {}
    _, events = sse_events(chat(sim, body("stream", stream=True), stream=True))
    assert sim.stats()["faults"] == {"stream_error": 1}
    last = events[-1]
    assert last["error"]["code"] == "server_error" and last["choices"][0]["finish_reason"] == "error"
    assert "[DONE]" not in events
    full = predict(body("stream"), BASELINE)["usage"]["completion_tokens"]
    billed = sim.stats()["billed_completion_tokens"]
    plain = predict(body("plain request"), BASELINE)["usage"]["completion_tokens"]
    assert 0 < billed - plain < full  # what was generated before the error


@pytest.mark.parametrize("billed_in_full", [True, False])
def test_stream_abandoned_by_its_client(sim: SimHandle, billed_in_full: bool) -> None:
    sim.configure(per_token_ms=2, stream_abort_billed=billed_in_full)
    payload = body("abandon me", stream=True)
    full = predict({**payload, "stream": False}, BASELINE)["usage"]["completion_tokens"]
    resp = chat(sim, payload, stream=True)
    next(resp.iter_lines())  # the first keep-alive: the stream is on
    resp.close()
    deadline = time.monotonic() + 5
    while (stats := sim.stats())["billed_requests"] == 0:
        assert time.monotonic() < deadline, "the abandoned stream was never billed"
        time.sleep(0.05)
    assert stats["abandoned_requests"] == 1 and stats["in_flight"] == 0
    if billed_in_full:
        assert stats["billed_completion_tokens"] == full
    else:
        assert stats["billed_completion_tokens"] < full / 2


# --- running it ---------------------------------------------------------------------------------


def test_many_concurrent_requests_wait_together(sim: SimHandle) -> None:
    # The real load figure comes from `python -m simulator.bench`; this only shows the overlap.
    # 2 s answers: long enough that 150 client threads all start within one, even on a busy box.
    sim.configure(latency_median_ms=2000, latency_p99_ms=2000)
    t0 = time.monotonic()
    with ThreadPoolExecutor(150) as pool:
        codes = list(pool.map(lambda i: chat(sim, body(f"c{i}")).status_code, range(150)))
    elapsed = time.monotonic() - t0
    assert codes == [200] * 150
    assert sim.stats()["max_in_flight"] >= 100
    assert elapsed < 8, f"150 requests of 2 s took {elapsed:.1f} s: they did not overlap"


def test_cli_flags_build_settings(tmp_path: Path) -> None:
    config = tmp_path / "sim.json"
    config.write_text(json.dumps({"rates": {"503": 0.2}, "hang_s": 9,
                                  "length_classes": {"short": {"content_mean": 7}}}))
    settings, _ = settings_from_args(["--config", str(config), "--hang-s", "3", "--fault", "429=0.1"])
    assert dict(settings.rates) == {"503": 0.2, "429": 0.1} and settings.hang_s == 3  # flags win
    assert settings.length_classes["short"].content_mean == 7
    settings, level = settings_from_args([
        "--port", "0", "--latency-median-ms", "5", "--fault", "429=0.1", "--fault", "leak_im_end=1",
        "--retry-after-s", "none", "--reasoning-details", "--providers", "A, B", "--log-level", "debug",
    ])
    assert settings.latency_median_ms == 5 and dict(settings.rates) == {"429": 0.1, "leak_im_end": 1.0}
    assert settings.retry_after_s is None and settings.reasoning_details is True
    assert settings.providers == ("A", "B") and level == "debug"
    settings, _ = settings_from_args([
        "--models", "a/b,c/d", "--context-length", "1000", "--max-completion-tokens", "none",
        "--price-in-per-mtok", "0.3", "--price-out-per-mtok", "1.2", "--price-request-usd", "0.01"])
    assert settings.served_models == ("moonshotai/kimi-k2.5", "a/b", "c/d")
    assert (settings.context_length, settings.max_completion_tokens) == (1000, None)
    assert settings_from_args(["--capacity-in-flight", "300", "--capacity-per-s", "50",
                               "--capacity-retry-after-s", "none", "--capacity-count-rejected"]
                              )[0].capacity_in_flight == 300
    assert settings.prices() == {"price_in_per_mtok": 0.3, "price_out_per_mtok": 1.2,
                                 "price_request_usd": 0.01}
    with pytest.raises(SettingsError, match=r"rates\.nope"):
        settings_from_args(["--fault", "nope=0.1"])


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "simulator", "--port", str(port), "--latency-median-ms", "0",
         "--expect-key", KEY],
        cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while True:
            try:
                requests.get(url + "/_sim/health", timeout=1)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "CLI simulator did not start"
                time.sleep(0.05)
        resp = requests.post(url + "/api/v1/chat/completions", json=body(), headers=AUTH, timeout=5)
        assert resp.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    log = out.decode()
    assert "listening on" in log and "status=200" in log and KEY not in log


def test_hf_tokenizer_counts(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    specials = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>",
                "</think>", "[UNK]"]
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials)},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    payload = script({"reasoning": "a b c", "content": "d e"})
    with start_in_thread(SimSettings(port=0, latency_median_ms=0, tokenizer=str(tmp_path))) as hf:
        data = chat(hf, payload).json()
    prompt = render_prompt(payload["messages"], [])
    assert data["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False).ids)
    assert data["usage"]["completion_tokens"] == 3 + 1 + 2 + 1  # specials are one token each


def test_a_plain_answer_is_generated_when_it_is_due_not_when_its_request_arrives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider generates on its own hardware: the simulator, which shares the client's box,
    spends its answer's CPU at the end of the latency, not in a burst as a wave of requests lands
    (a wave of 2,000 made it take a core for seconds). A stream's deltas are built up front."""
    real = server_module.generate
    generated_at: list[float] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        generated_at.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(server_module, "generate", recording)
    latency = SimSettings(port=0, latency_median_ms=800, latency_p99_ms=800, keepalive_s=0.05)
    with start_in_thread(latency) as handle:
        sent = time.monotonic()
        plain = chat(handle, body("due later"))
        answered = time.monotonic()
        assert plain.status_code == 200 and answered - sent >= 0.8
        assert generated_at[-1] - sent >= 0.7, generated_at[-1] - sent
        sent = time.monotonic()
        streamed = chat(handle, body("due now", stream=True))
        assert streamed.status_code == 200 and time.monotonic() - sent >= 0.8
        assert generated_at[-1] - sent < 0.5, generated_at[-1] - sent
    expected = predict(body("due later"), latency)
    assert plain.json()["choices"][0]["message"]["content"] == expected["message"]["content"]
    assert plain.json()["usage"] == expected["usage"]


def test_a_reset_forgets_every_request_seen(sim: SimHandle) -> None:
    """A reset simulator is a fresh one: a test handed a pooled simulator (harness/warm.py) counts
    only its own requests in ``/_sim/requests``, as in ``/_sim/stats``."""
    for text in ("one", "two"):
        assert chat(sim, body(text)).status_code == 200
    assert len(requests.get(sim.url + "/_sim/requests", timeout=10).json()["requests"]) == 2
    sim.reset()
    assert requests.get(sim.url + "/_sim/requests", timeout=10).json()["requests"] == []
    assert chat(sim, body("three")).status_code == 200
    assert len(requests.get(sim.url + "/_sim/requests", timeout=10).json()["requests"]) == 1
