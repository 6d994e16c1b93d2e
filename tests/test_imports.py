"""No import cycles between specfleet's modules, counting imports inside functions too: a cycle
is what made ``producer/cli.py`` and ``producer/demo.py`` import each other lazily."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "workers")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from producer import cli`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {f"{pkg}.{p.stem}": p for pkg in PACKAGES for p in (REPO / pkg).glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) & modules.keys() - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            if cycle := visit(dep, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    assert "producer.execute" in graph["producer.cli"]  # the graph sees function-level imports too
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _repo_sources() -> list[Path]:
    """The repo's own .py files (tracked, or new and not ignored): no virtualenv, no build output."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).exists()]


def test_nothing_outside_tests_imports_tests_or_edits_sys_path() -> None:
    """bench/, ops/, demo/, harness/ and the product take what they share with the tests from
    harness/, and run as modules from the repo's root (``python -m bench.x``), not by sys.path edits."""
    offenders = []
    for path in _repo_sources():
        rel = path.relative_to(REPO)
        if rel.parts[0] == "tests":
            continue
        imports = _imports(path)
        if any(name == "tests" or name.startswith("tests.") for name in imports):
            offenders.append(f"{rel}: imports tests")
        if "sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text():
            offenders.append(f"{rel}: edits sys.path")
    assert not offenders, offenders
