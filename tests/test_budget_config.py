"""Dollar budgets, the budget mode and the model's price in the run file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from common.budget import Price
from common.config import WorkerView, load_config
from common.errors import ConfigError
from harness import zygote

GOOD = """
[model]
name = "moonshotai/kimi-k2.5"
tokenizer = "tok"

[[datasets]]
name = "A"
path = "a.jsonl"
"""
PRICING = '\n[model.pricing]\nprompt = 6e-7\ncompletion = 2.5e-6\n'


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_hard_rule_without_dollar_limits(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD))
    assert (cfg.run.budget_mode, cfg.run.budget_usd, cfg.datasets[0].budget_usd) == ("hard", None, None)
    assert cfg.model.pricing is None and cfg.worker_view().model.pricing is None
    cfg.require_prices()  # no dollar budget: no price needed


def test_dollar_budgets_and_the_price_reach_the_worker_view(tmp_path: Path) -> None:
    text = GOOD + "budget_usd = 250\n" + PRICING + '\n[run]\nbudget_usd = 400.5\nbudget_mode = "projected"\n'
    cfg = load_config(_write(tmp_path, text))
    assert (cfg.run.budget_mode, cfg.run.budget_usd, cfg.datasets[0].budget_usd) == ("projected", 400.5, 250)
    view = WorkerView.model_validate_json(cfg.worker_view().model_dump_json()).model.pricing  # as workers load it
    assert view is not None and view.model_dump() == {"prompt": 6e-7, "completion": 2.5e-6, "request": 0.0}
    assert Price.of(view) == Price(6e-7, 2.5e-6, 0.0)
    cfg.require_prices()


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ('\n[run]\nbudget_mode = "soft"\n', ":11: run.budget_mode: Input should be 'hard' or 'projected'"),
        ("\n[run]\nbudget_usd = -1\n", ":11: run.budget_usd: Input should be greater than 0"),
        ("budget_usd = 0\n", ":9: datasets[0].budget_usd: Input should be greater than 0"),
        ("\n[model.pricing]\nprompt = 1e-6\n", ":10: model.pricing.completion: Field required"),
    ],
)
def test_bad_budget_fields_name_file_line_and_field(tmp_path: Path, snippet: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, GOOD + snippet))
    assert f"{tmp_path / 'fleet.toml'}{expected}" in str(err.value)


@pytest.mark.parametrize("snippet", ["budget_usd = 5\n", "\n[run]\nbudget_usd = 5\n"])
def test_a_dollar_budget_without_a_price_is_refused_before_any_request(tmp_path: Path, snippet: str) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": "1", "messages": [{"role": "user", "content": "hi"}]}\n')
    config = _write(tmp_path, GOOD + snippet)
    with pytest.raises(ConfigError, match=r"budget_usd needs the price of model 'moonshotai/kimi-k2.5'"):
        load_config(config).require_prices()
    # `specfleet run` says so in one line and stops before touching Redis (nothing listens there).
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "REDIS_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = zygote.run([sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress"],
                     env=env, timeout=60)
    assert out.returncode == 2 and "[model.pricing]" in out.stderr, out.stderr
