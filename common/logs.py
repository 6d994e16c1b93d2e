"""Logging setup for entry points, with the API key scrubbed from every record.

Library modules only do ``logging.getLogger(__name__)``; entry points call ``configure``.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Collection

# OpenRouter keys look like sk-or-v1-<64 hex>; any bearer token is scrubbed too.
_KEY_PATTERN = re.compile(r"(sk-or-[A-Za-z0-9-]{8,}|Bearer\s+[A-Za-z0-9._~+/=-]{8,})")
REDACTED = "[REDACTED]"
#: Literals every match of ``_KEY_PATTERN`` contains.
_MARKERS = ("sk-or-", "Bearer")


class RedactSecrets(logging.Filter):
    """Rewrites a record whose text holds the API key (or anything shaped like one)."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self._secrets = [s for s in secrets if s and len(s) >= 8]

    def scrub(self, text: str) -> str:
        # The common path: substring tests (C speed) prove the text holds neither a secret nor
        # anything the pattern could match (both of its branches start with these literals), so
        # the regex runs only on the rare record that might need it.
        if not any(marker in text for marker in _MARKERS) and not any(s in text for s in self._secrets):
            return text
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return _KEY_PATTERN.sub(REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.scrub(message)
        if record.exc_info and record.exc_info[1] is not None:
            # Exceptions can quote request headers; render now so the text can be scrubbed.
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        # Always the rendered text: the formatter would otherwise %-format the message again.
        record.msg, record.args = clean, None
        return True


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time, so a live progress display that redirects
    stderr (rich) prints log lines above its bars instead of through them."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure(level: str, secrets: Collection[str]) -> None:
    """The root logger's one handler, scrubbing ``secrets`` (``Settings.secrets``: the process's
    API keys, handed over by its entry point, never re-read from the environment here)."""
    handler = _CurrentStderr()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    )
    handler.addFilter(RedactSecrets(list(secrets)))
    # No format field needs the caller's file/line or the thread: skip the stack walk and the
    # current-thread lookup (gevent makes one per greenlet) that every record would pay for.
    logging._srcfile = None
    logging.logThreads = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # urllib3 logs every retry with the URL only, but its DEBUG level dumps headers.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
