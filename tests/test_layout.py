"""The layout rules of docs/architecture.md ("Layers"): import-linter's contracts hold, no package has an
import cycle, and only service/crud writes rows."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peagle_core", "service", "worker", "client", "cli")


def test_import_linter_contracts_are_kept() -> None:
    # The same check as CI's `lint-imports`; a broken contract's report is in the captured stdout.
    exit_code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert exit_code == 0, "an import-linter contract of pyproject.toml is broken (see stdout)"


def strongly_connected(edges: dict[str, set[str]]) -> Iterator[list[str]]:
    """Tarjan's strongly connected components of a directed graph, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    yield sorted(component)


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop (a module importing
    itself counts too)."""
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    return [c for c in strongly_connected(edges) if len(c) > 1 or c[0] in edges[c[0]]]


def test_strongly_connected_finds_loops_and_only_loops() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    components = list(strongly_connected(edges))
    assert ["a", "b", "c"] in components and ["e"] in components
    assert sorted(len(c) for c in components) == [1, 1, 1, 3]


def test_no_import_cycles() -> None:
    # Imports under `if TYPE_CHECKING:` count: a cycle that type checkers see is still a tangle to read.
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    cycles = import_cycles(graph)
    assert cycles == [], "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _row_classes() -> set[str]:
    from service.db.models import Base

    return {mapper.class_.__name__ for mapper in Base.registry.mappers}


def row_writes(path: Path, row_classes: set[str]) -> list[str]:
    """Where `path` builds a row object or imports SQLAlchemy's statement builders for writing."""
    tree = ast.parse(path.read_text(), filename=str(path))
    models: dict[str, str] = {}  # local name -> row class
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "service.db.models":
            models |= {a.asname or a.name: a.name for a in node.names if a.name in row_classes}
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            writers = {alias.name for alias in node.names} & {"insert", "update", "delete"}
            found += [f"line {node.lineno}: imports sqlalchemy's {name}" for name in sorted(writers)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in models:
            found.append(f"line {node.lineno}: builds a {models[node.func.id]} row")
    return found


def test_rows_are_written_only_through_service_crud() -> None:
    classes = _row_classes()
    crud = ROOT / "service" / "crud"
    offenders = {}
    for package in ("service", "worker", "client", "cli"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(crud) or path == ROOT / "service" / "db" / "models.py":
                continue
            if found := row_writes(path, classes):
                offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}, f"write rows through service.crud instead: {offenders}"


def test_row_write_scan_sees_a_write(tmp_path: Path) -> None:
    sample = tmp_path / "writer.py"
    sample.write_text(
        "from sqlalchemy import update\nfrom service.db.models import JobEvent as E\nE(job_id='j')\n"
    )
    assert row_writes(sample, _row_classes()) == [
        "line 1: imports sqlalchemy's update",
        "line 3: builds a JobEvent row",
    ]
