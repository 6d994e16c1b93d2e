"""The API key never leaves a log record, whatever carries it."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest

from common.logs import REDACTED, RedactSecrets
from tests.fleet import Fleet, prompts, write_jsonl

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

KEY = "sk-or-v1-" + "ab12" * 16


def _logger(stream: io.StringIO) -> logging.Logger:
    logger = logging.getLogger(f"redact-test-{id(stream)}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactSecrets([KEY]))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger


def test_key_in_message_args_and_exceptions_is_scrubbed() -> None:
    out = io.StringIO()
    log = _logger(out)
    log.info("headers %s", {"Authorization": f"Bearer {KEY}"})
    log.warning("raw key %s and a stranger's sk-or-v1-%s", KEY, "9" * 40)
    try:
        raise RuntimeError(f"request failed with Authorization: Bearer {KEY}")
    except RuntimeError:
        log.exception("call failed")
    text = out.getvalue()
    assert KEY not in text and "9" * 40 not in text
    assert text.count(REDACTED) >= 4
    assert "call failed" in text and "RuntimeError" in text  # the record itself survives


def test_a_strangers_bearer_token_is_scrubbed_and_plain_records_pass_unchanged() -> None:
    """The cheap path (no marker, no secret: no regex) must not let any shape the pattern covers through."""
    out = io.StringIO()
    log = _logger(out)
    log.info("proxy said Authorization: Bearer %s", "zz9ZZ9zz-token.value")
    log.info("D/p%d settle: kept tokens=%d", 7, 42)
    lines = out.getvalue().splitlines()
    assert lines == [f"proxy said Authorization: {REDACTED}", "D/p7 settle: kept tokens=42"]


# --- the real entry points: a `celery worker` at DEBUG and the producer CLI ------------------------

#: Not shaped like an OpenRouter key, so only the configured-secret list can catch it.
PLAIN_KEY = "plainkey" + "7f3a9c" * 8


@pytest.mark.fleet
def test_worker_and_producer_logs_never_show_the_configured_key(fleet: Fleet) -> None:
    """The key reaches a log record for real, in processes started as in production: the upstream
    echoes the model name (which here holds the key) in a 403 the worker logs as the prompt's
    failure, and the producer logs a malformed row's offending value (the key again)."""
    fleet.start_simulator("--latency-median-ms", "10", "--models", f"moonshotai/kimi-k2.5,{PLAIN_KEY}")
    rows: list[Any] = prompts(6, "k")
    for r in rows[:3]:
        r["messages"][0]["content"] = '#sim {"fail_attempts": [403]} ' + r["messages"][0]["content"]
    rows.append({"id": "bad", "messages": [{"role": PLAIN_KEY, "content": "x"}]})
    data = write_jsonl(fleet.tmp / "k.jsonl", rows)
    config = fleet.write_config([{"name": "K", "path": data, "length": "short", "budget_tokens": 10_000_000}])
    config.write_text(config.read_text().replace('name = "moonshotai/kimi-k2.5"', f'name = "{PLAIN_KEY}"'))
    env = {"OPENROUTER_API_KEY": PLAIN_KEY, "SPECFLEET_LOG_LEVEL": "DEBUG"}
    fleet.start_worker("w1", concurrency=5, **env)
    # --no-plan: the plan prints the model name (the key, here) to stdout on purpose; not a log record.
    producer = fleet._spawn("producer", [*fleet.producer_cmd(config), "--no-plan"], fleet.env(**env))
    assert producer.wait(timeout=120) == 0, fleet.all_logs()
    fleet.stop_all()
    worker_log, producer_log = fleet.log("w1"), fleet.log("producer")
    # The records that carried the key were written, scrubbed.
    failures = [line for line in worker_log.splitlines() if "failed: upstream_fatal" in line]
    assert len(failures) == 3 and all(f"{REDACTED} requires moderation" in f for f in failures), worker_log[-3000:]
    assert "DEBUG" in worker_log  # the worker really ran at DEBUG
    assert f"messages[0].role': '{REDACTED}'" in producer_log, producer_log[-3000:]
    assert PLAIN_KEY not in worker_log
    assert PLAIN_KEY not in producer_log
