"""Bad input gets an error naming where it is; good input parses into the prompt workers get."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from common.datasets import ReadStats, parse_row, read_prompts
from common.errors import ConfigError, DatasetRowError
from common.settings import Settings

GOOD = """
[model]
name = "moonshotai/kimi-k2.5"
tokenizer = "tok"

[[datasets]]
name = "B1_glaive"
path = "data/b1.jsonl"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_config_resolves_paths_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    cfg = load_config(_write(tmp_path, GOOD))
    ds = cfg.datasets[0]
    assert ds.path == tmp_path / "data" / "b1.jsonl" and ds.length == "short"
    assert ds.budget_tokens == 10_000_000
    assert cfg.model.tokenizer == str(tmp_path / "tok")  # a local folder becomes absolute
    assert cfg.output.dir == tmp_path / "out"
    assert cfg.config_id() == load_config(_write(tmp_path, GOOD)).config_id()


def test_config_errors_name_file_line_and_field(tmp_path: Path) -> None:
    bad = GOOD + '\n[[datasets]]\nname = "B2"\npath = "x.jsonl"\nlength = "medium"\nbudget_tokens = 0\n'
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, bad))
    text = str(err.value)
    assert f"{tmp_path / 'fleet.toml'}:13: datasets[1].length" in text
    assert f"{tmp_path / 'fleet.toml'}:14: datasets[1].budget_tokens" in text


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ('[model]\nname = "m"\ntokenizer = "t"\n', "datasets: Field required"),
        (GOOD + "\n[request]\ntemprature = 1\n", "request.temprature: Extra inputs are not permitted"),
        (GOOD + '\n[[datasets]]\nname = "B1_glaive"\npath = "y"\n', "dataset names must be unique"),
        (GOOD.replace('name = "B1_glaive"', 'name = "a b/c"'), "datasets[0].name"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_config_rejects(tmp_path: Path, snippet: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        load_config(_write(tmp_path, snippet))
    assert expected in str(err.value)


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_config(tmp_path / "nope.toml")


def test_settings_name_the_bad_variable() -> None:
    with pytest.raises(ConfigError, match="SPECFLEET_CONCURRENCY"):
        Settings.from_env({"SPECFLEET_CONCURRENCY": "lots"})
    with pytest.raises(ConfigError, match="REDIS_URL"):
        Settings.from_env({"REDIS_URL": "localhost:6379"})
    with pytest.raises(ConfigError, match="REDIS_URL is not set"):
        Settings.from_env({}).require_redis_url()
    s = Settings.from_env({"OPENROUTER_API_KEY": "sk-or-v1-secret"})
    assert "secret" not in repr(s)
    assert s.openrouter_base_url == "https://openrouter.ai"  # the real API unless told otherwise


def test_rows_in_both_forms_and_stable_ids() -> None:
    openai = parse_row('{"id": 7, "messages": [{"role": "user", "content": "hi"}], "tools": []}', "f:1")
    assert (openai.id, openai.tools) == ("7", None)
    share = parse_row('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}]}',
                      "f:2")
    assert share.messages == [{"role": "user", "content": "hi"}]  # the old answer is asked for again
    again = parse_row('{"conversations": [{"from": "human", "value": "hi"}]}', "f:9")
    assert share.id == again.id and share.id.startswith("h-")
    glaive = parse_row('{"messages": [{"role": "user", "content": "x"}], '
                       '"tools": "[{\\"name\\": \\"f\\", \\"parameters\\": {}}]"}', "f:3")
    assert glaive.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"x": 1}', "no 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
        ('{"messages": [{"role": "system", "content": "x"}]}', "no user message"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "conversations[0].from"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools[0]"),
        ('{"id": [1], "messages": [{"role": "user", "content": "x"}]}', "field 'id'"),
    ],
)
def test_bad_rows_name_file_line_and_field(line: str, reason: str) -> None:
    with pytest.raises(DatasetRowError) as err:
        parse_row(line, "data.jsonl:12")
    assert str(err.value).startswith("data.jsonl:12: ") and reason in str(err.value)


def test_reader_counts_bad_rows_and_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"id": "a", "messages": [{"role": "user", "content": "1"}]}\n'
        b"\n"
        b"\xff\xfe not utf-8\n"
        b'{"id": "a", "messages": [{"role": "user", "content": "dup"}]}\n'
        b'{"id": "b", "messages": [{"role": "user", "content": "2"}]}\n'
    )
    errors: list[DatasetRowError] = []
    stats = ReadStats()
    ids = [p.id for p in read_prompts(path, errors, stats)]
    assert ids == ["a", "b"]
    assert (stats.prompts, stats.malformed, stats.duplicates) == (2, 1, 1)
    assert [e.where for e in errors] == [f"{path}:3", f"{path}:4"]
    assert "first at line 1" in errors[1].reason


def test_check_command_reports_every_bad_row_and_sends_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "b1.jsonl").write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "messages": [\n'
    )
    config = _write(tmp_path, GOOD.replace('tokenizer = "tok"', 'tokenizer = "some/hub-id"'))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no REDIS_URL, no key: nothing to reach
    out = subprocess.run([sys.executable, "-m", "producer.cli", "check", str(config)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{tmp_path / 'data' / 'b1.jsonl'}:2: not valid JSON" in out.stdout
    assert "B1_glaive: 1 prompts, 1 malformed, 0 duplicate ids" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "producer.cli", "check", str(tmp_path / "missing.toml")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "missing.toml: cannot read run file" in bad.stderr


def test_passthrough_subcommands_keep_their_options() -> None:
    """``specfleet simulate --host …`` reaches the simulator's own parser (argparse alone drops it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "producer.cli", "simulate", "--host", "127.0.0.1", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "python -m simulator" in out.stdout, out.stderr


def test_run_refuses_missing_dataset_files_before_enqueueing_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = _write(tmp_path, GOOD)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run([sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert f"datasets[0] (B1_glaive).path: {tmp_path / 'data' / 'b1.jsonl'}: no such file" in out.stderr
