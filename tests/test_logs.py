"""The API key never leaves a log record, whatever carries it."""

from __future__ import annotations

import io
import logging

from common.logs import REDACTED, RedactSecrets

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
