"""End to end, real processes: an engine run whose engine serves another chat template than the run's
tokenizer. The simulator is started with a copy of the demo tokenizer whose template writes another
default system prompt for the prompts whose number is odd (half of them), so its
``prompt_token_ids`` differ from what the workers render for exactly those.

``[model] engine_prompt_mismatch = "refuse"`` (the default): the first such answer halts the run
(exit 3) with a line naming the dataset, the prompt, the first differing token and the fix, while
few rows are kept (the previous code kept every row, exit 0). ``"warn"``: every row is kept, exactly
the odd ones flagged, and the summary, the report and the producer's log warn for the dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis

from common.budget import Budget
from tests.fleet import DEMO_TOKENIZER, TEST_KEY, Fleet, read_summary
from workers.pipeline.engine_ids import PROMPT_MISMATCH_FIX

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

N_PROMPTS = 120
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
#: The harness' prompts end "explain {i} ✓": the character before " ✓" is i's last digit.
ODD_PROMPT = "messages[-1]['content'] is string and messages[-1]['content'][-3] in '13579'"


def other_template_tokenizer(folder: Path) -> Path:
    """The demo tokenizer with a chat template that renders odd-numbered prompts differently."""
    shutil.copytree(DEMO_TOKENIZER, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert DEFAULT_SYSTEM in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        DEFAULT_SYSTEM, f"{{% if {ODD_PROMPT} %}}You are an engine.{{% else %}}{DEFAULT_SYSTEM}{{% endif %}}")
    config_path.write_text(json.dumps(config))
    return folder


def _engine_run(fleet: Fleet, policy: str | None) -> Path:
    config = fleet.one_dataset("E", N_PROMPTS)
    line = '[model]\nupstream = "vllm"\n' + (f'engine_prompt_mismatch = "{policy}"\n' if policy else "")
    config.write_text(config.read_text().replace("[model]\n", line, 1))
    fleet.start_simulator("--latency-median-ms", "30", "--tokenizer", str(other_template_tokenizer(fleet.tmp / "tok")))
    fleet.start_worker("w1", concurrency=4, OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=fleet.sim_url + "/api/v1",
                       SPECFLEET_ENGINE_API_KEY=TEST_KEY)
    return config


def _odd(prompt_id: str) -> bool:
    return int(prompt_id[-1]) % 2 == 1


@pytest.mark.fleet
def test_another_chat_template_refuses_the_run_in_its_first_answers(fleet: Fleet, redis_client: redis.Redis) -> None:
    proc = fleet.start_producer(_engine_run(fleet, None))
    assert proc.wait(timeout=300) == 3, fleet.all_logs()
    out = fleet.log("producer")
    assert "the engine run was halted" in out and "dataset E, prompt e" in out, out[-3000:]
    assert "engine prompt ids differ from the run tokenizer's chat template at token" in out, out[-3000:]
    assert PROMPT_MISMATCH_FIX in out and "OPENROUTER_BASE_URL" not in out, out[-3000:]
    halted_on = out.split("dataset E, prompt ", 1)[1].split(":", 1)[0]
    assert _odd(halted_on)  # a prompt the other template renders differently
    # Decided in the first answers: the rows kept before the halt are a few of the even prompts
    # (the 4 in flight meanwhile), not the half a counter would have let through.
    kept = Budget(redis_client, "E").snapshot().rows
    assert kept < N_PROMPTS // 10, kept
    answered = fleet.sim_stats()["requests"]
    assert answered < N_PROMPTS // 4, answered


@pytest.mark.fleet
def test_warn_keeps_every_row_and_warns_for_the_dataset(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.run_producer(_engine_run(fleet, "warn"), timeout_s=300)
    rows = fleet.assert_exactly_once(redis_client, "E", N_PROMPTS)
    flagged = {r["id"] for r in rows if not r["engine_check"]["prompt_match"]}
    assert flagged == {r["id"] for r in rows if _odd(r["id"])}
    summary = read_summary(fleet.out, "E")
    assert (summary["engine_rows"], summary["engine_prompt_mismatch"]) == (N_PROMPTS, len(flagged))
    warning = summary["engine_prompt_warning"]
    assert warning.startswith(f"{len(flagged):,} of {N_PROMPTS:,} engine rows have prompt ids unlike"), warning
    assert f"**warning**: {warning}" in (fleet.out / "report.md").read_text()
    assert warning in fleet.log("producer")
