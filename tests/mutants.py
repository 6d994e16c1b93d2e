"""``make mutants``: one-line mutants of the README's promises, each run against the tests that guard it.

Every mutant in ``tests/mutants.toml`` names a file, an exact snippet that must occur in it exactly
once, its replacement, the tests that guard it and the promise in words. For each one a fresh copy
of the repository (never the working tree) gets the replacement and pytest runs the guarding tests
there, with ``PYTHONPATH`` pointing at the copy (the copy needs no venv of its own). A mutant is
*caught* when those tests fail, *survived* when they pass. A snippet that no longer matches, or a
guarding test file that does not exist, is reported as such and counts against the run, so a stale
list cannot pass silently. Exit status 0 only when every mutant was caught.

    python -m tests.mutants [-j 2] [-k NAME_SUBSTRING] [--list] [--baseline] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIST = Path(__file__).resolve().parent / "mutants.toml"
#: Never copied: the shared venv, VCS data, caches and run output.
_SKIP = {".venv", ".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis",
         "out", "demo-out", "build", "dist"}
_FIELDS = {"name", "file", "original", "replacement", "tests", "promise", "k"}


class ListError(Exception):
    """The mutant list itself is wrong (a field missing, a name twice)."""


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    #: pytest targets: files or node ids, relative to the repository root.
    tests: tuple[str, ...]
    promise: str
    #: optional ``-k`` expression narrowing the targets.
    k: str = ""


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str  # caught | survived | stale | missing-test | error; with --baseline: passes | fails
    detail: str
    seconds: float

    @property
    def caught(self) -> bool:
        return self.verdict in ("caught", "passes")


def load(path: Path = LIST) -> list[Mutant]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    mutants: list[Mutant] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("mutant", [])):
        where = f"{path.name}: mutant[{i}]"
        unknown = set(raw) - _FIELDS
        if unknown:
            raise ListError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        missing = [f for f in ("name", "file", "original", "replacement", "tests", "promise") if f not in raw]
        if missing:
            raise ListError(f"{where}: missing {', '.join(missing)}")
        if raw["name"] in seen:
            raise ListError(f"{where}: name {raw['name']!r} used twice")
        if raw["original"] == raw["replacement"]:
            raise ListError(f"{where} ({raw['name']}): replacement equals the original")
        tests = raw["tests"] if isinstance(raw["tests"], list) else [raw["tests"]]
        seen.add(raw["name"])
        mutants.append(Mutant(raw["name"], raw["file"], raw["original"], raw["replacement"], tuple(tests),
                              raw["promise"], raw.get("k", "")))
    return mutants


def _copy_repo(dest: Path) -> Path:
    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _SKIP or n.endswith((".pyc", ".egg-info"))}

    root = dest / "repo"
    shutil.copytree(REPO, root, ignore=ignore, symlinks=True)
    return root


def apply(root: Path, m: Mutant) -> str | None:
    """Applies ``m`` in the copy at ``root``; returns why it could not be applied, or None."""
    target = root / m.file
    if not target.is_file():
        return f"mutant {m.name}: file {m.file} not found"
    text = target.read_text(encoding="utf-8")
    count = text.count(m.original)
    if count != 1:
        found = "not found" if count == 0 else f"found {count} times"
        return f"mutant {m.name}: snippet {found} in {m.file}: {m.original.strip()[:80]!r}"
    target.write_text(text.replace(m.original, m.replacement), encoding="utf-8")
    return None


def _test_files(m: Mutant) -> list[str]:
    return [t.split("::", 1)[0] for t in m.tests]


def pytest_cmd(m: Mutant) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *m.tests]
    if m.k:
        cmd += ["-k", m.k]
    return cmd


def _run_pytest(root: Path, m: Mutant, timeout_s: float, log: Path) -> tuple[int | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENROUTER_", "SPECFLEET_", "REDIS_"))}
    env["PYTHONPATH"] = str(root)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    with log.open("wb") as fh:  # kept with --keep
        proc = subprocess.Popen(pytest_cmd(m), cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    # Whatever the tests started (workers, simulator) goes with them.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(errors="replace")


def _summary_line(output: str) -> str:
    """The first failing test and the first line of why (pytest's ``E`` lines)."""
    lines = [x for x in output.strip().splitlines() if x.strip()]
    failed = [x.split(" - ")[0] for x in lines if x.startswith(("FAILED", "ERROR"))]
    why = [x[1:].strip() for x in lines if x.startswith("E ") and x[1:].strip()]
    head = failed[0] if failed else (lines[-1] if lines else "no output")
    return (head + (f" | {why[0]}" if why else ""))[:240]


def run_one(m: Mutant, *, mutate: bool, timeout_s: float, keep: bool) -> Outcome:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"specfleet-mutant-{m.name}-"))
    try:
        root = _copy_repo(tmp)
        absent = [f for f in _test_files(m) if not (root / f).is_file()]
        if absent:
            return Outcome(m, "missing-test", f"guarding test missing: {', '.join(absent)}",
                           time.monotonic() - started)
        if mutate and (why := apply(root, m)):
            return Outcome(m, "stale", why, time.monotonic() - started)
        code, output = _run_pytest(root, m, timeout_s, tmp / "pytest.log")
        took = time.monotonic() - started
        if code is None:
            return Outcome(m, "caught" if mutate else "fails", f"tests timed out after {timeout_s:g} s", took)
        if code == 0:
            return Outcome(m, "survived" if mutate else "passes", _summary_line(output), took)
        if code == 1:  # tests ran and some failed
            return Outcome(m, "caught" if mutate else "fails", _summary_line(output), took)
        # 2 interrupted/collection error, 4 usage error, 5 nothing collected: the guard did not run.
        return Outcome(m, "error", f"pytest exit {code}: {_summary_line(output)}", took)
    finally:
        if keep:
            print(f"  kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("-k", dest="only", default="", help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the mutants and check their snippets")
    parser.add_argument("--baseline", action="store_true",
                        help="run each mutant's guarding tests unmutated instead (they must pass)")
    parser.add_argument("--timeout-s", type=float, default=900, help="per mutant (a hang counts as caught)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)

    mutants = [m for m in load() if args.only in m.name]
    if not mutants:
        print(f"no mutant matches {args.only!r}", file=sys.stderr)
        return 2
    if args.list:
        return _list(mutants)

    mode = "baseline (unmutated)" if args.baseline else "mutants"
    print(f"{len(mutants)} {mode}, {args.jobs} at a time, each on a fresh copy of {REPO}", flush=True)
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, m, mutate=not args.baseline, timeout_s=args.timeout_s, keep=args.keep)
                   for m in mutants]
        for fut in futures:
            o = fut.result()
            outcomes.append(o)
            print(f"  {o.verdict.upper():12} {o.mutant.name:40} {o.seconds:6.1f} s  {o.detail}", flush=True)

    width = max(len(o.mutant.name) for o in outcomes)
    print(f"\n{'mutant':{width}}  {'result':12}  guarding tests")
    for o in outcomes:
        guard = " ".join(o.mutant.tests) + (f" -k {o.mutant.k!r}" if o.mutant.k else "")
        print(f"{o.mutant.name:{width}}  {o.verdict:12}  {guard}")
    caught = sum(o.caught for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} {'passed unmutated' if args.baseline else 'caught'}; "
          f"{len(outcomes) - caught} not" + ("" if caught == len(outcomes) else ":"))
    for o in outcomes:
        if not o.caught:
            print(f"  {o.mutant.name}: {o.verdict}: {o.detail}\n    promise: {o.mutant.promise}")
    return 0 if caught == len(outcomes) else 1


def _list(mutants: list[Mutant]) -> int:
    """Checks every snippet against the working tree without running anything."""
    bad = 0
    for m in mutants:
        target = REPO / m.file
        count = target.read_text(encoding="utf-8").count(m.original) if target.is_file() else -1
        absent = [f for f in _test_files(m) if not (REPO / f).is_file()]
        state = "ok" if count == 1 else ("file missing" if count < 0 else f"snippet found {count} times")
        if absent:
            state = f"guarding test missing: {', '.join(absent)}" if state == "ok" else f"{state}; tests missing"
        bad += state != "ok"
        print(f"{m.name:40} {m.file:22} {state}\n    {m.promise}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
