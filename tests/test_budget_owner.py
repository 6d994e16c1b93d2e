"""common/budget.py is the only Python that names a field of the budget hashes."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from common.budget import FIELDS

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "workers", "producer", "simulator", "tests", "bench", "demo", "ops")
OWNER = REPO / "common" / "budget.py"
_STRING_PARTS = {tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())


def budget_field_mentions(path: Path) -> list[str]:
    """``file:line: field`` for each string literal of ``path`` that contains a budget field name."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, FIELDS)) + r")\b")
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in _STRING_PARTS:
            found += [f"{path.relative_to(REPO)}:{tok.start[0]}: {m}" for m in pattern.findall(tok.string)]
    return found


def test_no_python_outside_budget_py_names_a_budget_field() -> None:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if p != OWNER]
    assert len(files) > 40
    offenders = [hit for p in files for hit in budget_field_mentions(p)]
    assert offenders == [], "budget fields named outside common/budget.py:\n" + "\n".join(offenders)


def test_the_scan_sees_the_fields_where_they_are_named() -> None:
    # Guards the scan itself: the owner names every field, and the scan finds each of them there.
    named = {hit.rsplit(": ", 1)[1] for hit in budget_field_mentions(OWNER)}
    assert named == set(FIELDS)
    lua = (REPO / "common" / "budget.lua").read_text(encoding="utf-8")
    assert all(f'"{f}"' in lua for f in FIELDS), "FIELDS lists a name budget.lua does not use"
