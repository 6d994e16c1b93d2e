"""Bad input gets an error naming where it is; good input parses into the prompt workers get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from common.datasets import ReadStats, parse_row, read_prompts
from common.errors import ConfigError, DatasetRowError
from common.settings import Settings
from harness import zygote

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
    assert "an earlier row has it" in errors[1].reason


def test_check_command_reports_every_bad_row_and_sends_nothing(tmp_path: Path) -> None:
    import sys

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "b1.jsonl").write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "messages": [\n'
    )
    config = _write(tmp_path, GOOD.replace('tokenizer = "tok"', 'tokenizer = "some/hub-id"'))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no REDIS_URL, no key: nothing to reach
    out = zygote.run([sys.executable, "-m", "producer.cli", "check", str(config)], env=env, timeout=60)
    assert out.returncode == 1, out.stderr  # a malformed row is a problem found
    assert f"{tmp_path / 'data' / 'b1.jsonl'}:2: not valid JSON" in out.stdout
    assert "B1_glaive: 1 prompts, 1 malformed, 0 duplicate ids" in out.stdout
    bad = zygote.run([sys.executable, "-m", "producer.cli", "check", str(tmp_path / "missing.toml")],
                     env=env, timeout=60)
    assert bad.returncode == 2 and "missing.toml: cannot read run file" in bad.stderr


def test_passthrough_subcommands_keep_their_options() -> None:
    """``specfleet simulate --host …`` reaches the simulator's own parser (argparse alone drops it)."""
    import sys

    out = zygote.run([sys.executable, "-m", "producer.cli", "simulate", "--host", "127.0.0.1", "--help"],
                     timeout=60)
    assert out.returncode == 0 and "python -m simulator" in out.stdout, out.stderr


def test_run_refuses_missing_dataset_files_before_enqueueing_anything(tmp_path: Path) -> None:
    import sys

    config = _write(tmp_path, GOOD)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0"}
    out = zygote.run([sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress"],
                     env=env, timeout=60)
    assert out.returncode == 2
    assert f"datasets[0] (B1_glaive).path: {tmp_path / 'data' / 'b1.jsonl'}: no such file" in out.stderr


def test_a_bom_before_the_first_row_keeps_that_row(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "first", "messages": [{"role": "user", "content": "hi"}]}\n'
                     b'{"id": "second", "messages": [{"role": "user", "content": "yo"}]}\n')
    errors: list[DatasetRowError] = []
    stats = ReadStats()
    assert [p.id for p in read_prompts(path, errors, stats)] == ["first", "second"]
    assert errors == [] and stats.malformed == 0


def test_text_parts_become_the_string_the_template_renders() -> None:
    """Parts are joined with nothing between them: Kimi's template renders parts exactly so, and
    the demo tokenizer's template renders the joined string and the parts to the same text."""
    from transformers import AutoTokenizer

    from tests.fleet import DEMO_TOKENIZER

    parts = [{"type": "text", "text": "Explain "}, {"type": "text", "text": "gevent ✓"}]
    row = {"id": "p", "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                   {"role": "user", "content": parts}]}
    prompt = parse_row(json.dumps(row), "f:1")
    assert prompt.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Explain gevent ✓"}]
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    as_parts = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    as_text = tok.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    assert as_text == as_parts and "Explain gevent ✓" in as_text


def test_tool_turns_and_null_content_with_tool_calls_still_parse() -> None:
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"}]}
    prompt = parse_row(json.dumps(row), "f:1")
    # null reads as "": Qwen3's own template cannot render a null content, and "" renders alike.
    assert prompt.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert prompt.messages[2]["content"] == "42" and prompt.messages[0]["content"] == "go"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ([1, 2], "messages[1].content[0]: a part must be an object"),
        ({"text": "x"}, "messages[1].content: must be a string, a list of text parts or null, not dict"),
        (7, "messages[1].content: must be a string, a list of text parts or null, not int"),
        ([], "messages[1].content: an empty list of parts"),
        ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
         "messages[1].content[1].type: 'image_url' parts are not supported"),
        ([{"type": "text", "text": 3}], "messages[1].content[0].text: must be a string"),
    ],
)
def test_other_content_is_an_error_naming_file_line_and_field(content: object, reason: str) -> None:
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}]}
    with pytest.raises(DatasetRowError) as err:
        parse_row(json.dumps(row), "data.jsonl:5")
    assert str(err.value).startswith(f"data.jsonl:5: {reason}"), str(err.value)


def test_a_5mb_line_is_refused_by_size_and_the_rest_still_reads(tmp_path: Path) -> None:
    import tracemalloc

    path = tmp_path / "big.jsonl"
    huge = json.dumps({"id": "huge", "messages": [{"role": "user", "content": "x" * 5_000_000}]}).encode()
    with path.open("wb") as fh:
        fh.write(b'{"id": "a", "messages": [{"role": "user", "content": "1"}]}\r\n')
        fh.write(huge + b"\n")
        fh.write(b'{"id": "b", "messages": [{"role": "user", "content": "2"}]}\n')
        fh.write(b'{"id": "c", "messages": [{"role": "user", "content": "' + b"y" * 999_900 + b'"}]}\n')
    errors: list[DatasetRowError] = []
    stats = ReadStats()
    tracemalloc.start()
    ids = [p.id for p in read_prompts(path, errors, stats)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ids == ["a", "b", "c"]  # a line just under 1 MB still reads
    assert [str(e) for e in errors] == [f"{path}:2: line_too_long ({len(huge):,} bytes > 1,000,000)"]
    assert stats.malformed == 1
    assert peak < 4_000_000, f"reading held {peak:,} bytes at once: the 5 MB line was read whole"
    errors.clear()
    small = [p.id for p in read_prompts(path, errors, ReadStats(), max_line_bytes=100)]
    assert small == ["a", "b"] and [e.where for e in errors] == [f"{path}:2", f"{path}:4"]


def test_max_line_bytes_is_a_dataset_setting(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD + "max_line_bytes = 2_000_000\n"))
    assert cfg.datasets[0].max_line_bytes == 2_000_000
    assert load_config(_write(tmp_path, GOOD)).datasets[0].max_line_bytes == 1_000_000
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.max_line_bytes"):
        load_config(_write(tmp_path, GOOD + "max_line_bytes = 0\n"))


def test_a_partial_length_class_keeps_the_other_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD + "\n[lengths.short]\nmax_tokens = 4096\n"))
    assert cfg.length_for("short").max_tokens == 4096
    assert cfg.length_for("short").timeout_s == 600  # the default, not "timeout_s: Field required"
    assert cfg.length_for("long").max_tokens == 32_768
