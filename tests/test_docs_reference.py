"""The manual's reference pages and .env.example are what the code generates now (ops/gen_reference.py).

A key, flag, variable, metric, exit code or row field the code has and the committed pages lack, or
the other way round, fails here; so does one the code declares without a meaning. The last tests
generate from a model with a key removed, and one with a key added, to show both are caught.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import NotRequired

import pytest

from common.config import RetryConfig, RunConfig, _Strict
from common.contract import ResultRow
from common.settings import Settings, _env, _whole
from ops import gen_reference as gen
from producer import cli

REPO = Path(__file__).resolve().parent.parent


def test_the_committed_pages_are_what_the_code_generates() -> None:
    stale = [str(p.relative_to(REPO)) for p in gen.stale(gen.pages())]
    assert not stale, f"{', '.join(stale)} differ from the code: run `python -m ops.gen_reference` and commit"


def test_every_page_is_in_the_manual() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    for page in gen.pages():
        if page.parent == gen.REFERENCE:
            assert f"reference/{page.name}" in nav, page


# RetryConfig without in_flight_wait_max_s: a key removed from the code.
class RetryLessOne(_Strict):
    max_attempts: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0


class RunConfigLessOne(RunConfig):
    retry: RetryLessOne = RetryLessOne()  # type: ignore[assignment]


class RetryPlusOne(RetryConfig):
    #: Seconds of jitter added to each backoff: a key added to the code, with its meaning.
    jitter_s: float = 0.5
    undocumented_s: float = 1.0


class RunConfigPlusOne(RunConfig):
    retry: RetryPlusOne = RetryPlusOne()


def test_a_key_removed_from_the_code_is_caught() -> None:
    committed = (gen.REFERENCE / "config.md").read_text()
    assert "| `in_flight_wait_max_s` |" in committed
    page = gen.config_page(RunConfigLessOne)
    assert "`in_flight_wait_max_s`" not in page and page != committed


def test_an_added_key_is_caught_documented_or_not() -> None:
    with pytest.raises(gen.Undocumented, match=r"retry\.undocumented_s"):
        gen.config_page(RunConfigPlusOne)
    gen.NOTES["retry.undocumented_s"] = "documented now"
    try:
        page = gen.config_page(RunConfigPlusOne)
    finally:
        del gen.NOTES["retry.undocumented_s"]
    assert "| `jitter_s` | number | `0.5` | Seconds of jitter" in page
    assert page != (gen.REFERENCE / "config.md").read_text()  # the committed page lacks them: stale


def test_a_note_for_a_key_the_code_lacks_is_caught() -> None:
    gen.NOTES["retry.no_such_key"] = "stale"
    try:
        with pytest.raises(gen.Undocumented, match=r"retry\.no_such_key"):
            gen.config_page()
    finally:
        del gen.NOTES["retry.no_such_key"]


@dataclasses.dataclass(frozen=True)
class SettingsPlusOne(Settings):
    new_thing: int = dataclasses.field(default=3, metadata=_env("SPECFLEET_NEW_THING", _whole))


def test_an_environment_variable_without_a_meaning_is_caught() -> None:
    assert "SPECFLEET_NEW_THING" not in (gen.REFERENCE / "environment.md").read_text()
    with pytest.raises(gen.Undocumented, match="SPECFLEET_NEW_THING"):
        gen.settings_rows(SettingsPlusOne)


class RowPlusOne(ResultRow):
    new_field: NotRequired[int]


def test_a_row_field_without_a_meaning_is_caught() -> None:
    with pytest.raises(gen.Undocumented, match="new_field"):
        gen.row_fields(RowPlusOne)


def test_a_flag_added_to_the_parser_is_caught() -> None:
    def with_flag(help_: str | None) -> argparse.ArgumentParser:
        p = cli.parser()
        run = gen.subcommands(p)[0][2]
        run.add_argument("--new-flag", action="store_true", help=help_)
        return p

    with pytest.raises(gen.Undocumented, match="--new-flag"):
        gen.cli_page(lambda: with_flag(None))
    assert gen.cli_page(lambda: with_flag("a new flag")) != (gen.REFERENCE / "cli.md").read_text()


def test_the_product_never_imports_the_generator() -> None:
    """ops/gen_reference.py reads the product; the product (a worker image, the producer) never needs it."""
    importers = [str(p.relative_to(REPO)) for pkg in ("common", "workers", "producer", "simulator")
                 for p in (REPO / pkg).rglob("*.py") if "gen_reference" in p.read_text()]
    assert not importers, importers
