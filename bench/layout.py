"""Layout figures of a source tree, one JSON line each: longest files, import cycles, cross-layer imports,
repeated blocks of six or more lines, the places that write each kind of database row, how many times
the event, reporter, evaluation-report and figure types (speed-up row, acceptance, serving verdict,
recommendation) are defined, and the names defined in more than one product module.

    python bench/layout.py                 # this checkout
    python bench/layout.py --root /tmp/old # another checkout, e.g. `git worktree add /tmp/old <rev>`

The layers are docs/architecture.md's: peagle_core <- service <- worker <- client <- cli. A tree from
before `client/` and `cli/` existed is measured the same way (its packages are whichever of the five exist).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path from tests/test_layout.py too
from _common import emit

# Lowest layer first: a module may import from its own layer or a lower one.
LAYERS = ("peagle_core", "service", "worker", "client", "cli")
BLOCK = 6  # lines in a repeated block
WRITE_FUNCS = {"insert", "update", "delete", "pg_insert", "sqlite_insert"}
# Type names (classes or module-level aliases) each kind has gone by; one definition of each is the goal.
TYPE_KINDS = {
    "event": re.compile(r"^(Event|EventFn|OnEvent)$"),
    "metrics_callback": re.compile(r"^MetricsFn$"),
    "reporter": re.compile(r"^Reporter$"),
    # What the pipeline (`Callbacks`) and the trainer (`Hooks`, rank 0 only) are given beside the reporter:
    # stop requests, progress counters, stored outputs. Counted apart: they hold a Reporter, not redefine it.
    "run_controls": re.compile(r"^(Callbacks|Hooks)$"),
    "evaluation_report": re.compile(r"^(EvaluationReport|EvalReport)$"),
    # The four figure types of issue 43, under every name each has gone by (views.Speedup / SpeedupRow,
    # report.SpeedupFigures; EvalResult, gate.Acceptance, AcceptanceFigures; ServingFigures). The
    # recommendation's per-batch entry (`BatchChoice`) is part of the recommendation, not a type of its own
    # kind; vLLM's `VllmRun` is a batch of generations with its counters, whose acceptance is `Acceptance`.
    "speedup_row": re.compile(r"^(Speedup|SpeedupRow|SpeedupFigures|SpeedupResult)$"),
    "acceptance": re.compile(r"^(Acceptance|AcceptanceFigures|EvalResult)$"),
    "serving_verdict": re.compile(r"^(ServingCheck|ServingFigures|ServingVerdict)$"),
    "recommendation": re.compile(r"^(ServingRecommendation|Recommendation)$"),
}
FIGURE_KINDS = ("speedup_row", "acceptance", "serving_verdict", "recommendation")
# Names defined in more than one module on purpose, each with why: role names (one per module by role) and
# the two sides of a protocol; not one thing defined twice.
SHARED_NAMES = {
    "log": "each module's logger, logging.getLogger(__name__)",
    "router": "each routes module's FastAPI APIRouter",
    "app": "each `peagle` sub-command group's typer app",
    "register": "each package's hook that adds its commands to the `peagle` CLI",
    "main": "a console script's entry point",
    "T": "a module's own TypeVar",
    "build_app": "a console script's typer app builder: `peagle` (cli) and the library's own (peagle_core.cli)",
    "TERMINAL_STATUSES": "the job statuses the API calls final, on both sides of HTTP: the SDK never imports the "
    "server (import-linter's sdk-standalone); tests/test_layout.py checks that the two agree",
}


# Run in a child process of the measured tree: a one-step toy job (online hidden states, no regeneration),
# every call of `peagle_core.io.sha256_file` counted per file, wherever a module imported it.
_HASH_PASSES_JOB = """
import collections, json, sys, tempfile
from pathlib import Path
import peagle_core.io as pio
import peagle_core.data.prepare, peagle_core.regeneration.rewrite  # their sha256_file is patched too
import peagle_core.pipeline.stages as stages
from peagle_core.spec import parse_spec
from peagle_core.toy import build_toy_verifier, write_toy_dataset

original, passes = pio.sha256_file, collections.Counter()

def counting(path, *args, **kwargs):
    passes[str(Path(path).resolve())] += 1
    return original(path, *args, **kwargs)

for module in list(sys.modules.values()):
    if getattr(module, "__dict__", {}).get("sha256_file") is original:
        setattr(module, "sha256_file", counting)
with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    verifier = build_toy_verifier("test", seed=0, cache_dir=work / "toy")
    data = write_toy_dataset(work / "data.jsonl", n=64, seed=0)
    spec = parse_spec({
        "verifier": {"name_or_path": str(verifier)},
        "dataset": {"path": str(data), "seq_len": 128, "val_fraction": 0.1},
        "hidden_states": {"mode": "online"},
        "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 256},
        "training": {"total_seq_len": 256, "max_steps": 1},
        "evaluation": {"prompts": 0}, "export": {"vllm_check": False},
    })
    result = stages.run_pipeline(spec, work / "run")
    print(json.dumps({"status": result.status, "passes": passes[str(data.resolve())]}))
"""


def hash_passes(root: Path) -> dict[str, Any]:
    """How many times one job reads its dataset file to hash it (`_HASH_PASSES_JOB`, run on `root`)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _HASH_PASSES_JOB],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def source_files(root: Path) -> list[Path]:
    return sorted(p for pkg in LAYERS if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))


def longest_files(root: Path, n: int = 5) -> list[tuple[str, int]]:
    sizes = [(str(p.relative_to(root)), len(p.read_text().splitlines())) for p in source_files(root)]
    return sorted(sizes, key=lambda s: -s[1])[:n]


def modules_per_package(root: Path) -> dict[str, int]:
    """Modules (.py files, __init__ included) in each package and sub-package, by dotted name."""
    counts: dict[str, int] = {}
    for p in source_files(root):
        pkg = ".".join(p.relative_to(root).parent.parts)
        counts[pkg] = counts.get(pkg, 0) + 1
    return dict(sorted(counts.items()))


def longest_functions(root: Path, n: int = 5) -> list[tuple[str, int]]:
    """The `n` longest functions or methods (lines from `def` to the last line of the body)."""
    sizes = []
    for p in source_files(root):
        rel = str(p.relative_to(root))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                sizes.append((f"{rel}:{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(sizes, key=lambda s: -s[1])[:n]


# -- imports -------------------------------------------------------------------------------------------

_GRAPH_SCRIPT = """
import json, sys, grimp
pkgs = [p for p in sys.argv[1:]]
g = grimp.build_graph(*pkgs, exclude_type_checking_imports=False, cache_dir=None)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def import_edges(root: Path) -> dict[str, set[str]]:
    """Module -> modules it imports directly (TYPE_CHECKING imports included), built by grimp in a child
    process whose path starts at `root`, so another checkout's packages are the ones found."""
    pkgs = [p for p in LAYERS if (root / p / "__init__.py").is_file()]
    out = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT, *pkgs],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {m: set(v) for m, v in json.loads(out).items()}


def strongly_connected(edges: dict[str, set[str]]) -> Iterator[list[str]]:
    """Tarjan's strongly connected components of a directed graph, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(edges[root])))]
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


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop (a module importing itself
    counts too)."""
    return [c for c in strongly_connected(edges) if len(c) > 1 or c[0] in edges.get(c[0], ())]


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between the top-level packages themselves (e.g. service <-> worker)."""
    top: dict[str, set[str]] = defaultdict(set)
    for importer, imported in edges.items():
        for target in imported:
            a, b = importer.split(".")[0], target.split(".")[0]
            if a != b:
                top[a].add(b)
            top.setdefault(b, set())
    return cycles(dict(top))


def cross_layer_imports(edges: dict[str, set[str]]) -> list[str]:
    """Module imports that point up the layers (a lower layer importing a higher one)."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    return sorted(
        f"{importer} -> {target}"
        for importer, imported in edges.items()
        for target in imported
        if rank[importer.split(".")[0]] < rank[target.split(".")[0]]
    )


# -- repeated blocks -------------------------------------------------------------------------------------

_SKIP = re.compile(r"^(#|import |from \S+ import |@|\)|\]|\}|\)?:$|pass$|else:$|try:$|finally:$|\"\"\"|''')")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that carry code: no blanks, comments, imports, lone
    brackets or docstring fences, which would make any two files look alike."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text and not _SKIP.match(text):
            out.append((number, text))
    return out


def repeated_blocks(root: Path) -> list[str]:
    """Maximal runs of >= BLOCK consecutive code lines that stand the same (after stripping) in two places.

    Windows of BLOCK lines are hashed; two places sharing a window and then the next one (the same offset
    between them) belong to one block, so a 20-line copy counts once, not fifteen times.
    """
    files = {str(p.relative_to(root)): _code_lines(p) for p in source_files(root)}
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        for i in range(len(lines) - BLOCK + 1):
            windows[tuple(t for _, t in lines[i : i + BLOCK])].append((name, i))
    diagonals: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for places in windows.values():
        if len(places) < 2:
            continue
        for a in range(len(places)):
            for b in range(a + 1, len(places)):
                (fa, ia), (fb, ib) = places[a], places[b]
                if (fa, ia) > (fb, ib):
                    (fa, ia), (fb, ib) = (fb, ib), (fa, ia)
                if fa == fb and ib - ia < BLOCK:
                    continue  # a run repeating itself (e.g. a table of similar rows) overlaps
                diagonals[(fa, fb, ib - ia)].append(ia)
    blocks = []
    for (fa, fb, offset), starts in diagonals.items():
        starts.sort()
        run_start = prev = starts[0]
        for s in [*starts[1:], None]:
            if s is not None and s == prev + 1:
                prev = s
                continue
            first, last = files[fa][run_start][0], files[fa][prev + BLOCK - 1][0]
            other_first = files[fb][run_start + offset][0]
            other_last = files[fb][prev + offset + BLOCK - 1][0]
            blocks.append(f"{fa}:{first}-{last} ~ {fb}:{other_first}-{other_last}")
            if s is not None:
                run_start = prev = s
    return sorted(blocks)


# -- row writers -----------------------------------------------------------------------------------------


def row_classes(root: Path) -> set[str]:
    """Classes with a __tablename__: the ORM's row types, wherever the tree defines them."""
    names = set()
    for path in source_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(s, ast.Assign)
                and any(getattr(t, "id", None) == "__tablename__" for t in s.targets)
                for s in node.body
            ):
                names.add(node.name)
    return names


def _written_class(call: ast.Call, classes: set[str]) -> str | None:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name in classes and isinstance(func, ast.Name):
        return name  # Job(...): a new row
    if (
        name in WRITE_FUNCS
        and call.args
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id in classes
    ):
        return call.args[0].id  # update(Job) / insert(JobEvent) / delete(ApiKey)
    if name in {"update", "delete"} and isinstance(func, ast.Attribute):
        # session.query(Job).filter(...).update(...): the query's first argument is the row type
        inner = func.value
        while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            if inner.func.attr == "query" and inner.args and isinstance(inner.args[0], ast.Name):
                return inner.args[0].id if inner.args[0].id in classes else None
            inner = inner.func.value
    return None


def row_writers(root: Path) -> dict[str, list[str]]:
    """Row type -> the functions (file:function) that build or update/insert/delete rows of it."""
    classes = row_classes(root)
    writers: dict[str, set[str]] = defaultdict(set)
    for path in source_files(root):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        scopes: list[tuple[ast.AST, str]] = [(tree, "<module>")]
        while scopes:
            scope, name = scopes.pop()
            for node in ast.iter_child_nodes(scope):
                stack = [node]
                while stack:
                    n = stack.pop()
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                        scopes.append((n, n.name if name == "<module>" else f"{name}.{n.name}"))
                        continue
                    if isinstance(n, ast.ClassDef):
                        scopes.append((n, n.name))
                        continue
                    if isinstance(n, ast.Call) and (cls := _written_class(n, classes)):
                        writers[cls].add(f"{rel}:{name}")
                    stack.extend(ast.iter_child_nodes(n))
    return {cls: sorted(writers[cls]) for cls in sorted(classes)}


def _bound_names(node: ast.stmt, definitions: Any) -> list[str]:
    """The names a top-level statement binds: a definition of the `definitions` kinds, or an assignment."""
    if isinstance(node, definitions):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def type_definitions(root: Path) -> dict[str, list[str]]:
    """For each kind in TYPE_KINDS, the `module:Name` of every top-level class or alias defining it."""
    found: dict[str, list[str]] = {kind: [] for kind in TYPE_KINDS}
    for path in source_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            for name in _bound_names(node, ast.ClassDef):
                for kind, pattern in TYPE_KINDS.items():
                    if pattern.match(name):
                        found[kind].append(f"{path.relative_to(root)}:{name}")
    return found


def duplicate_names(root: Path) -> dict[str, list[str]]:
    """Public top-level names (functions, classes, module-level assignments) that more than one product
    module defines, but for the role names of SHARED_NAMES: name -> the modules."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in source_files(root):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            for name in _bound_names(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not name.startswith("_") and name not in SHARED_NAMES:
                    where[name].append(str(path.relative_to(root)))
    return {name: sorted(set(ms)) for name, ms in sorted(where.items()) if len(set(ms)) > 1}


def bench_edges(root: Path) -> dict[str, set[str]]:
    """bench/'s scripts (a folder of scripts, not a package: they import each other's modules by name
    after putting bench/ on the path) -> the bench modules each imports."""
    bench = root / "bench"
    scripts = {p.stem for p in bench.glob("*.py")} if bench.is_dir() else set()
    edges: dict[str, set[str]] = {}
    for name in sorted(scripts):
        imported = set()
        for node in ast.walk(ast.parse((bench / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        edges[f"bench.{name}"] = {f"bench.{m}" for m in imported & scripts}
    return edges


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--label", default=None, help="tag every line with this (e.g. before/after)")
    parser.add_argument("--no-job", action="store_true", help="skip hash_passes_per_job (a one-step toy job)")
    parser.add_argument("--verbose", action="store_true", help="list every cycle, import, block and writer")
    args = parser.parse_args()
    root = args.root.resolve()
    if not any((root / p / "__init__.py").is_file() for p in LAYERS):
        parser.error(f"--root {root}: none of {', '.join(LAYERS)} is a package there")
    label = args.label or root.name
    edges = import_edges(root)
    found_cycles = cycles(edges | bench_edges(root))
    crossing = cross_layer_imports(edges)
    blocks = repeated_blocks(root)
    writers = row_writers(root)
    emit(tree=label, measure="modules_per_package", packages=modules_per_package(root))
    emit(tree=label, measure="longest_files", files=dict(longest_files(root)))
    emit(tree=label, measure="longest_functions", functions=dict(longest_functions(root)))
    emit(tree=label, measure="import_cycles", count=len(found_cycles), package_cycles=package_cycles(edges),
         cycles=found_cycles if args.verbose else [" <-> ".join(c[:4]) for c in found_cycles])  # fmt: skip
    emit(tree=label, measure="cross_layer_imports", count=len(crossing),
         imports=crossing if args.verbose else crossing[:10])  # fmt: skip
    emit(tree=label, measure="repeated_blocks", min_lines=BLOCK, count=len(blocks),
         blocks=blocks if args.verbose else blocks[:10])  # fmt: skip
    emit(tree=label, measure="row_writers", places={cls: len(w) for cls, w in writers.items()},
         outside_crud={cls: [w for w in ws if not w.startswith("service/crud/")] for cls, ws in writers.items()},
         writers=writers if args.verbose else None)  # fmt: skip
    types = type_definitions(root)
    emit(tree=label, measure="type_definitions", counts={k: len(v) for k, v in types.items()}, where=types)
    duplicates = duplicate_names(root)
    emit(tree=label, measure="duplicate_names", count=len(duplicates), shared_by_role=sorted(SHARED_NAMES),
         names=duplicates if args.verbose else sorted(duplicates))  # fmt: skip
    if not args.no_job:
        emit(tree=label, measure="hash_passes_per_job", **hash_passes(root))


if __name__ == "__main__":
    main()
