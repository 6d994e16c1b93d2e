"""Every repo path a comment, docstring or page names exists: ``workers/fleet/recovery.py``,
``common/budget.lua:42`` (a line number must be inside the file), and a package-relative
``fleet/recovery.py`` under some top folder. A module moved or renamed leaves no pointer to where
it used to be. Another repository's path is written ``owner/repo:path`` (not checked)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The kinds of file that are read for paths, and that a path may name.
SCANNED = (".py", ".lua", ".toml", ".yaml", ".yml", ".md")
NAMED = (*SCANNED, ".json", ".sh", ".txt", ".cfg", ".ini", ".jinja")


@cache
def _files() -> tuple[str, ...]:
    """The repo's files, tracked or new and not ignored (no virtualenv, no build output)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return tuple(line for line in out.splitlines() if (REPO / line).exists())


def _tops() -> list[str]:
    return sorted({f.split("/", 1)[0] for f in _files() if "/" in f})


def _pattern() -> re.Pattern[str]:
    """A path from a top folder of the repo, or from one of their sub-folders, to a file of a
    ``NAMED`` kind, not inside a URL, another path or ``owner/repo:path``, with an optional ``:line``."""
    folders = {*_tops(), *(f.split("/")[1] for f in _files() if f.count("/") >= 2)}
    names = "|".join(map(re.escape, sorted(folders, key=len, reverse=True)))
    kinds = "|".join(re.escape(k[1:]) for k in sorted(NAMED, key=len, reverse=True))
    return re.compile(rf"(?<![\w./:-])((?:{names})/[\w./-]*?\.(?:{kinds}))(?::(\d+))?(?![\w/-])")


def _resolve(path: str) -> Path | None:
    """The file ``path`` names: from the repo's root, else from a top folder (package-relative)."""
    for base in (REPO, *(REPO / top for top in _tops())):
        if (base / path).is_file():
            return base / path
    return None


def stale_paths(text: str, pattern: re.Pattern[str]) -> list[str]:
    """The paths ``text`` names that do not exist (or whose ``:line`` is past the file's end)."""
    stale = []
    for m in pattern.finditer(text):
        path, line = m[1], m[2]
        target = _resolve(path)
        if target is None:
            stale.append(path)
        elif line is not None and int(line) > len(target.read_bytes().splitlines()):
            stale.append(f"{path}:{line} (the file has {len(target.read_bytes().splitlines())} lines)")
    return stale


def test_every_path_named_in_the_repo_exists() -> None:
    pattern = _pattern()
    found = []
    for rel in _files():
        if not rel.endswith(SCANNED) or rel == "tests/test_paths_in_comments.py":  # its examples are stale on purpose
            continue
        text = (REPO / rel).read_text(encoding="utf-8", errors="replace")
        found += [f"{rel}: names {p}" for p in stale_paths(text, pattern)]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_stale_path() -> None:
    """Not vacuous: a moved module, a line past the end, and the forms that are no repo path."""
    pattern = _pattern()
    assert stale_paths("# see workers/redelivery.py for why", pattern) == ["workers/redelivery.py"]
    assert stale_paths("-- common/budget.lua:999999 says", pattern)[0].startswith("common/budget.lua:999999")
    assert stale_paths("# fleet/redelivery.py", pattern) == ["fleet/redelivery.py"]
    assert stale_paths("(``common/budget.lua:1``, workers/fleet/recovery.py, fleet/recovery.py)", pattern) == []
    assert stale_paths("https://github.com/x/y/blob/main/common/nothing.py, out/common/x.py, vllm-project/vllm:tests/"
                       "openai/x.py", pattern) == []
