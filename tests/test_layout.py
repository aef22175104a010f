"""The layout rules of docs/architecture.md ("Layers"): import-linter's contracts hold, no package has an
import cycle, and only service/crud writes rows."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peagle_core", "service", "worker", "client", "cli")


def test_import_linter_contracts_are_kept() -> None:
    # The same check as CI's `lint-imports`; a broken contract's report is in the captured stdout.
    exit_code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert exit_code == 0, "an import-linter contract of pyproject.toml is broken (see stdout)"


def _load_layout_bench() -> Any:
    """bench/layout.py, whose graph code this test shares (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("layout_bench", ROOT / "bench" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layout = _load_layout_bench()


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    return layout.cycles({m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules})


def test_strongly_connected_finds_loops_and_only_loops() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    components = list(layout.strongly_connected(edges))
    assert ["a", "b", "c"] in components and ["e"] in components
    assert sorted(len(c) for c in components) == [1, 1, 1, 3]
    assert sorted(layout.cycles(edges)) == [["a", "b", "c"], ["e"]]


def test_layout_bench_counts_upward_imports_and_repeated_blocks(tmp_path: Path) -> None:
    edges = {"service.app": {"worker.store", "peagle_core.spec"}, "cli.main": {"service.app"}}
    assert layout.cross_layer_imports(edges) == ["service.app -> worker.store"]
    body = "".join(f"    total += value_{i} * {i}\n" for i in range(7))
    (tmp_path / "service").mkdir()
    for name in ("a", "b"):
        (tmp_path / "service" / f"{name}.py").write_text(
            f"def {name}():\n    total = 0\n{body}    return total\n"
        )
    assert layout.repeated_blocks(tmp_path) == ["service/a.py:2-10 ~ service/b.py:2-10"]


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


def test_each_figure_type_is_defined_once() -> None:
    # Issue 43 item 1: the speed-up row, acceptance, serving verdict and recommendation, each defined once
    # in peagle_core and read as-is by the page, the CLI and the report (bench/layout.py's measure).
    where = layout.type_definitions(ROOT)
    assert {kind: len(where[kind]) for kind in layout.FIGURE_KINDS} == dict.fromkeys(
        layout.FIGURE_KINDS, 1
    ), where
    assert all(w.startswith("peagle_core/") for kind in layout.FIGURE_KINDS for w in where[kind]), where


def test_no_name_is_defined_in_two_product_modules() -> None:
    # Issue 43 item 2: one name per thing. bench/layout.py's SHARED_NAMES holds the names defined more than
    # once on purpose (a role each module plays, the two sides of a protocol), each with its reason.
    assert layout.duplicate_names(ROOT) == {}


def test_the_sdk_and_the_server_agree_on_the_terminal_statuses() -> None:
    # Defined on both sides of HTTP on purpose (SHARED_NAMES): the SDK never imports the server.
    import client.sdk
    import service.db.models

    assert client.sdk.TERMINAL_STATUSES == service.db.models.TERMINAL_STATUSES
    assert client.sdk.TERMINAL_STATUSES.issubset(service.db.models.JOB_STATUSES)


def test_duplicate_name_scan_sees_a_name_defined_twice(tmp_path: Path) -> None:
    for pkg, body in (
        ("peagle_core", "class Speedup:\n    pass\nlog = 1\n"),
        ("service", "def Speedup(): ...\nlog = 2\n"),
    ):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "figures.py").write_text(body)
    assert layout.duplicate_names(tmp_path) == {"Speedup": ["peagle_core/figures.py", "service/figures.py"]}
    assert layout.type_definitions(tmp_path)["speedup_row"] == ["peagle_core/figures.py:Speedup"]


def test_no_import_cycles_in_product_and_bench() -> None:
    edges = layout.import_edges(ROOT) | layout.bench_edges(ROOT)
    assert any(m.startswith("bench.") for m in edges) and edges["bench.layout"] == {"bench._common"}
    assert layout.cycles(edges) == []
