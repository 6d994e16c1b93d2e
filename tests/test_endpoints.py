"""Base URLs as users write them (common/endpoints.py): every form reaches every route, in a table, over
real HTTP against the simulator, and end to end through a fleet given ``http://host:port/v1``."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import redis
import requests

from common.contract import HALT_MISCONFIGURED, halt_line
from common.endpoints import ACCEPTED_FORMS, ENGINE_ROOT, Endpoints
from common.errors import ConfigError, MisconfiguredError
from common.settings import Settings
from producer.account import fetch_account
from producer.models import fetch_endpoints, fetch_model
from simulator import SimHandle, SimSettings, start_in_thread
from tests.fleet import Fleet, read_summary
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.openrouter_batch import BatchClient
from workers.upstreams.upstream import Request
from workers.upstreams.vllm import EngineClient

KEY = "sk-or-v1-test"
MODEL = "moonshotai/kimi-k2.5"

# (base URL as written, API root for OPENROUTER_BASE_URL, API root for SPECFLEET_ENGINE_URL)
TABLE = [
    # OpenRouter's docs and the OpenAI SDK
    ("https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1"),
    ("https://openrouter.ai/api/v1/", "https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1"),
    # the site: a bare host gets the layout's root
    ("https://openrouter.ai", "https://openrouter.ai/api/v1", "https://openrouter.ai/v1"),
    ("https://openrouter.ai/", "https://openrouter.ai/api/v1", "https://openrouter.ai/v1"),
    # the full chat URL: stripped
    ("https://openrouter.ai/api/v1/chat/completions", "https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1"),
    ("https://openrouter.ai/api/v1/chat/completions/", "https://openrouter.ai/api/v1",
     "https://openrouter.ai/api/v1"),
    # vLLM, SGLang, llama.cpp, LiteLLM
    ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1"),
    ("http://10.0.0.5:8000/v1/", "http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1"),
    ("http://10.0.0.5:8000/v1/chat/completions", "http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1"),
    ("http://10.0.0.5:8000", "http://10.0.0.5:8000/api/v1", "http://10.0.0.5:8000/v1"),
    ("http://[::1]:8000/v1", "http://[::1]:8000/v1", "http://[::1]:8000/v1"),
    # hosted OpenAI-style APIs whose root is deeper; any other path is the root as written
    ("https://api.fireworks.ai/inference/v1", "https://api.fireworks.ai/inference/v1",
     "https://api.fireworks.ai/inference/v1"),
    ("https://gw.example/openai/", "https://gw.example/openai", "https://gw.example/openai"),
]


@pytest.mark.parametrize(("base", "openrouter_root", "engine_root"), TABLE)
def test_every_form_of_the_base_url_gives_every_route(base: str, openrouter_root: str, engine_root: str) -> None:
    routes = Endpoints.of(base)
    assert routes.root == openrouter_root
    assert (routes.chat, routes.models, routes.key, routes.credits, routes.generation, routes.batches) == tuple(
        openrouter_root + p for p in ("/chat/completions", "/models", "/key", "/credits", "/generation", "/batches"))
    assert routes.model_endpoints(MODEL + ":nitro") == f"{openrouter_root}/models/{MODEL}/endpoints"
    assert Endpoints.of(base, bare_root=ENGINE_ROOT).root == engine_root
    # What the clients use is this, not a derivation of their own.
    chat = OpenRouterClient(base, KEY, pool_size=1, app_url="", app_title="")
    assert chat.url == openrouter_root + "/chat/completions"
    assert BatchClient(base, KEY, app_url="", app_title="", submit_timeout_s=1).url == openrouter_root + "/batches"
    assert EngineClient("vllm", base, None, pool_size=1).url == engine_root + "/chat/completions"


@pytest.mark.parametrize("base", ["http://h:8000/v1?key=x", "http://h:8000/v1#top", "http:///v1"])
def test_a_base_url_without_routes_is_refused_naming_the_variable(base: str) -> None:
    with pytest.raises(ValueError):
        Endpoints.of(base)
    with pytest.raises(ConfigError, match=r"^environment variable OPENROUTER_BASE_URL: "):
        Settings.from_env({"OPENROUTER_BASE_URL": base})
    with pytest.raises(ConfigError, match=r"^environment variable SPECFLEET_ENGINE_URL: "):
        Settings.from_env({"SPECFLEET_ENGINE_URL": base})


# --- over real HTTP: the simulator serves OpenRouter's /api/v1/... and an engine's /v1/... ------------


@pytest.fixture(scope="module")
def sim() -> Iterator[SimHandle]:
    with start_in_thread(SimSettings(port=0, latency_median_ms=0, models=(MODEL,), batch_models=(MODEL,),
                                     balance_usd=30, management_key=KEY, generation_delay_s=0)) as handle:
        yield handle


FORMS = ["", "/", "/api/v1", "/api/v1/", "/api/v1/chat/completions", "/v1", "/v1/", "/v1/chat/completions"]


@pytest.mark.parametrize("suffix", FORMS)
def test_each_form_reaches_chat_generation_models_endpoints_account_and_batches(sim: SimHandle, suffix: str) -> None:
    base = sim.url + suffix
    client = OpenRouterClient(base, KEY, pool_size=1, app_url="https://x", app_title="t")
    answer = client.complete(Request(model=MODEL, messages=[{"role": "user", "content": "q"}], tools=None,
                                     max_tokens=20, params={}, timeout_s=10))
    assert answer.usage["completion_tokens"] > 0
    generation = requests.get(Endpoints.of(base).generation, params={"id": answer.generation_id},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert generation.status_code == 200, generation.text
    assert fetch_model(base, MODEL).batch_pricing is not None
    assert fetch_endpoints(base, MODEL)
    account = fetch_account(base, KEY)
    assert account.key_known and account.total_credits_usd == 30, account
    assert BatchClient(base, KEY, app_url="", app_title="", submit_timeout_s=10).listed(time.time() - 60) == []


def test_a_404_names_the_url_tried_and_the_halt_line_the_forms_accepted(sim: SimHandle) -> None:
    client = OpenRouterClient(sim.url + "/openai", KEY, pool_size=1, app_url="", app_title="")
    with pytest.raises(MisconfiguredError) as caught:
        client.complete(Request(model=MODEL, messages=[{"role": "user", "content": "q"}], tools=None, max_tokens=5,
                                params={}, timeout_s=10))
    assert caught.value.status == 404 and caught.value.target.startswith(f"{sim.url}/openai/chat/completions ")
    line = halt_line(HALT_MISCONFIGURED, f"{caught.value.target} answered http_404: no route")
    assert f"{sim.url}/openai/chat/completions" in line and f"accepted: {ACCEPTED_FORMS})" in line


# --- end to end --------------------------------------------------------------------------------------

N_PROMPTS = 60


@pytest.mark.fleet
def test_a_fleet_given_the_engine_style_v1_base_url_runs_and_a_wrong_path_halts_naming_the_forms(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--models", MODEL)
    v1, api_v1 = fleet.sim_url + "/v1", fleet.sim_url + "/api/v1"
    config = fleet.one_dataset("U", N_PROMPTS)
    # A wrong path first: the first requests' 404 halts the fleet, the line names the URL and the forms.
    fleet.start_worker("wrong", concurrency=4, OPENROUTER_BASE_URL=fleet.sim_url + "/openai")
    producer = fleet.start_producer(config, "producer1", "--no-plan", env={"OPENROUTER_BASE_URL": v1})
    assert producer.wait(timeout=120) == 3, fleet.all_logs()
    halted = [ln for ln in fleet.log("producer1").splitlines() if ln.startswith("specfleet: halted:")]
    assert len(halted) == 1, fleet.log("producer1")
    assert f"{fleet.sim_url}/openai/chat/completions with model '{MODEL}' answered http_404" in halted[0]
    assert f"accepted: {ACCEPTED_FORMS})" in halted[0]
    fleet.signal("wrong", 9)

    # The engine style for the producer's plan (models, endpoints, key, credits) and one worker, the
    # OpenRouter SDK style for another: the same command resumes and finishes.
    fleet.start_worker("w1", concurrency=5, OPENROUTER_BASE_URL=v1)
    fleet.start_worker("w2", concurrency=5, OPENROUTER_BASE_URL=api_v1)
    out = fleet.run_producer(config, name="producer2", env={"OPENROUTER_BASE_URL": v1})
    assert f"({v1}/models)" in out and f"{v1}/models/{MODEL}/endpoints" in out, out
    assert not re.search(r"unknown \((GET|no )", out), out  # price, account and endpoints all read
    fleet.assert_exactly_once(redis_client, "U", N_PROMPTS)
    assert read_summary(fleet.out, "U")["failed"] == 0
