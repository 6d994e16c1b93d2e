"""A ``.env`` file read as ``docker compose`` reads it, for the ``specfleet`` command.

Compose reads ``.env`` next to compose.yaml by itself; a user who copied ``.env.example`` and then
runs ``specfleet plan`` in the same folder expects the same values. Only what compose's plain form
needs: ``KEY=value`` lines, ``#`` comments, an optional ``export``, one pair of quotes. A variable
already in the environment wins, as it does for compose. No interpolation (compose's ``${…}`` is
for compose.yaml's own variables, which specfleet does not read).
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path

from common.errors import ConfigError

_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")


def parse(text: str, where: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ConfigError(f"{where}:{number}: not KEY=value")
        value = m[2]
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:  # compose: an unquoted value ends at a comment
            value = value.split(" #", 1)[0].rstrip()
        values[m[1]] = value
    return values


def load(path: Path = Path(".env"), env: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each variable of ``path`` not already set in ``env`` (``os.environ``); the names set."""
    env = os.environ if env is None else env
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    added = []
    for key, value in parse(text, str(path)).items():
        if key not in env:
            env[key] = value
            added.append(key)
    return added
