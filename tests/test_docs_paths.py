"""The docs name only code that exists: every backticked reference to one of our packages in README.md,
docs/*.md and bench/results/README.md (`peagle_core.training.loop`, `peagle_core/model/loss.py`,
`peagle_core.spec.JobSpec`, `worker.tasks.run_job(job_id)`, `bench/chaos.py --node-loss 2`) must name a
module, folder or file that is there, and a name that module (or a class of it) defines.

References are resolved by reading the source (no imports: some modules pull in vLLM): the longest prefix
that is a module or package, then a name defined at its top level (a def, class, assignment or import), then
one member of that class. Deeper attributes (a field's own fields) are not checked. Fenced code blocks and
backticked text that does not start with one of the packages (`spec.dataset.path`, `K=4`) are left alone.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]
PACKAGES = ("peagle_core", "service", "worker", "client", "cli", "bench", "tests")

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_NAME = r"[A-Za-z_]\w*"
# A dotted path (`peagle_core.spec.JobSpec`) or a file path (`bench/chaos.py`, `worker/`), optionally with
# `:name` after a file; it must end where the reference does (a call's `(`, a space, `/`, `*`, the end).
_REF = re.compile(
    rf"^(?P<ref>(?:{'|'.join(PACKAGES)})(?:(?:\.{_NAME})+|/[\w./-]*(?::{_NAME}(?:\.{_NAME})*)?)?)(?![\w-])"
)


# The old side of a rename the docs record (`worker/main` → `worker/pool`, `tests/api` became ...) is gone
# by definition.
_RENAMED = re.compile(r"\s*(?:→|->|became\b|was renamed\b)")


def references(text: str) -> list[str]:
    """The backticked references to our packages in a Markdown text, in order (but the old names of
    renames)."""
    found = []
    text = _FENCE.sub("", text)
    for m in _INLINE.finditer(text):
        ref = _REF.match(m.group(1).strip())
        if ref is None or ref.group("ref") in PACKAGES or _RENAMED.match(text, m.end()):
            continue
        found.append(ref.group("ref"))
    return found


@functools.cache
def _defined(path: Path) -> dict[str, set[str] | None]:
    """Top-level names of a module -> the member names of a class (None for anything else)."""
    names: dict[str, set[str] | None] = {}
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:`, `try: import ...`
            body.extend([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])])
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
        elif isinstance(node, ast.ClassDef):
            names[node.name] = _members(node, classes)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], None)
        else:
            for target in _targets(node):
                names.setdefault(target, None)
    return names


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _members(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str] | None:
    """The names a class defines, its same-module bases' included; None (unchecked) when it inherits
    from a class elsewhere (pydantic's BaseModel, Exception), whose members are not read."""
    members: set[str] = set()
    for base in cls.bases:
        if not (isinstance(base, ast.Name) and base.id in classes and base.id != cls.name):
            return None
        inherited = _members(classes[base.id], classes)
        if inherited is None:
            return None
        members |= inherited
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(node.name)
        else:
            members.update(_targets(node))
    return members


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _resolve_names(module: Path, names: list[str]) -> str | None:
    """None when `names` (attribute after attribute) are defined in `module`; else what is missing."""
    if not names:
        return None
    defined = _defined(module)
    if names[0] not in defined:
        return f"{module.relative_to(ROOT)} defines no {names[0]!r}"
    members = defined[names[0]]
    if len(names) > 1 and members is not None and names[1] not in members:
        return f"{names[0]} (in {module.relative_to(ROOT)}) has no member {names[1]!r}"
    return None


def problem(ref: str) -> str | None:
    """None when `ref` names something that exists; else what is missing."""
    if "/" in ref:
        path, _, names = ref.partition(":")
        target = ROOT / path
        if target.exists():
            return _resolve_names(target, names.split(".")) if names and target.suffix == ".py" else None
        if (ROOT / f"{path.rstrip('/')}.py").is_file():
            return None  # `worker/pool`: the module worker/pool.py
        if path.endswith((".py", "/")) or names:
            return f"no file or folder {path}"
        ref = path.replace("/", ".")  # `tests/core/helpers.final_weights`
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        module = _module_file(parts[:i])
        if module is not None:
            return _resolve_names(module, parts[i:])
    return f"no module {parts[0]}"


def test_the_reference_finder_takes_only_our_paths() -> None:
    text = (
        "`peagle_core.spec.JobSpec` and `worker.tasks.run_job(job_id)`, `bench/chaos.py --node-loss 2`, "
        "`service.queue.mark_alive/is_alive`, `peagle_core.model.*`, `peagle_core/io.py:sha256_file`, "
        "but not `spec.dataset.path`, `cli` alone, `client_id`, `servicer.x`, `K=4`, nor `worker/main` → "
        "`worker/pool`'s old side.\n"
        "```\npeagle_core.in_a_fence\n```\n"
    )
    assert references(text) == [
        "peagle_core.spec.JobSpec",
        "worker.tasks.run_job",
        "bench/chaos.py",
        "service.queue.mark_alive",
        "peagle_core.model",
        "peagle_core/io.py:sha256_file",
        "worker/pool",
    ]


def test_references_that_are_gone_are_found() -> None:
    assert problem("peagle_core.spec.JobSpec") is None
    assert problem("peagle_core.spec.JobSpec.model_validate") is None  # pydantic's members are not read
    assert problem("peagle_core/io.py:sha256_file") is None
    assert problem("tests/core/helpers.final_weights") is None
    assert problem("peagle_core.hidden_states.cache_codec") is not None  # a module that is gone
    assert problem("peagle_core.spec.NoSuchSpec") is not None
    assert problem("peagle_core.pipeline.stages.Pipeline.no_such_stage") is not None
    assert problem("peagle_core/no_such.py") is not None
    assert problem("worker/no_such") is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_backticked_path_in_the_docs_exists(doc: Path) -> None:
    missing = [f"`{ref}`: {why}" for ref in references(doc.read_text()) if (why := problem(ref))]
    assert not missing, f"{doc.relative_to(ROOT)} names code that is not there:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------ CLI flags named in the docs

_BENCH_CMD = re.compile(r"bench/(\w+\.py)")
# `peagle` as a command, not as a value (`--methods peagle,eagle3`) or part of a name
_PEAGLE_CMD = re.compile(r"(?<![\w/.-])peagle(?![\w,.=-])((?:[ \t]+[a-z][a-z-]*)*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_INDENTED = re.compile(r"^(?: {4}|\t)\S.*$", re.M)


def command_lines(text: str) -> list[str]:
    """The code a Markdown text shows, one command line each: inline spans (which may wrap lines), fenced
    and indented blocks (a trailing `\\` continues the line)."""
    lines = []
    for block in re.findall(r"^```.*?\n(.*?)^```", text, re.M | re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = _FENCE.sub("", text)
    lines += [m.group(0).replace("\\\n", " ") for m in _INDENTED.finditer(prose.replace("\\\n    ", " "))]
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", _INDENTED.sub("", prose))]
    return lines


def named_flags(line: str) -> list[tuple[str, str]]:
    """(program, flag) for every `--flag` after a bench script (`bench/x.py`) or a `peagle` command
    (`peagle jobs submit`) in one command line, up to the next program or shell separator."""
    starts = sorted([(m.start(), m.end(), m.group(1)) for m in _BENCH_CMD.finditer(line)]
                    + [(m.start(), m.end(), "peagle" + m.group(1)) for m in _PEAGLE_CMD.finditer(line)])  # fmt: skip
    found = []
    for i, (_, end, program) in enumerate(starts):
        rest = line[end : starts[i + 1][0] if i + 1 < len(starts) else len(line)]
        rest = re.split(r"&&|;| \| ", rest)[0]
        found += [(" ".join(program.split()), flag) for flag in _FLAG.findall(rest)]
    return found


@functools.cache
def _peagle_command() -> object:
    import typer

    from cli import build_app

    return typer.main.get_command(build_app())


def peagle_flags(words: list[str]) -> tuple[str, set[str]]:
    """The `peagle` command the words name (the longest prefix that is one) and every flag it, or any
    command under it, takes."""
    cmd, path = _peagle_command(), ["peagle"]
    for word in words:
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            break
        cmd, path = sub, [*path, word]
    flags, todo = {"--help"}, [cmd]
    while todo:
        node = todo.pop()
        for param in getattr(node, "params", []):
            flags.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        todo += list(getattr(node, "commands", {}).values())
    return " ".join(path), flags


def flag_problem(program: str, flag: str) -> str | None:
    """None when `program` (a bench script's file name, or `peagle ...`) takes `flag`."""
    if program.startswith("peagle"):
        name, flags = peagle_flags(program.split()[1:])
        return None if flag in flags else f"`{name}` has no {flag}"
    from tests.bench.scripts import script_help

    scripts = script_help()
    if program not in scripts:
        return f"no bench script {program}"
    return None if flag in _FLAG.findall(str(scripts[program]["help"])) else f"bench/{program} has no {flag}"


def test_the_flag_finder_reads_commands_wherever_the_docs_show_them() -> None:
    text = (
        "Run `bench/real_model.py --drafter DIR\n--ks 2` or `peagle jobs submit SPEC.yaml -f --no-such`.\n\n"
        "    python bench/scaling.py --budgets 3e5 \\\n        --plot x.png && peagle up --port 1\n\n"
        "```\npeagle demo --size test\n```\n`--not-a-command`, `peagle-service[vllm]`, `pip install -e .`\n"
    )
    found = sorted({pair for line in command_lines(text) for pair in named_flags(line)})
    assert found == sorted([
        ("real_model.py", "--drafter"), ("real_model.py", "--ks"), ("peagle jobs submit", "--no-such"),
        ("scaling.py", "--budgets"), ("scaling.py", "--plot"), ("peagle up", "--port"), ("peagle demo", "--size"),
    ])  # fmt: skip
    assert flag_problem("peagle jobs submit", "--follow") is None
    assert flag_problem("peagle jobs submit SPEC.yaml", "--no-such") is not None
    assert flag_problem("real_model.py", "--train-data") is not None  # the removed flag the docs once named


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_the_docs_name_is_in_its_parser(doc: Path) -> None:
    pairs = {pair for line in command_lines(doc.read_text()) for pair in named_flags(line)}
    wrong = sorted(why for program, flag in pairs if (why := flag_problem(program, flag)))
    assert not wrong, f"{doc.relative_to(ROOT)} names flags the commands do not take:\n" + "\n".join(wrong)
