"""The bench scripts' `--help`, all in one child process (torch is imported once for every script): what
tests/bench/test_bench_scripts.py runs and tests/test_docs_paths.py reads the flags from."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))

# Each script run as `python bench/x.py --help` would be, one after another in one interpreter; one JSON
# line per script: its exit code (or the error) and what it printed.
_HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException:
        code = traceback.format_exc(limit=-3)
    print(json.dumps({"script": script, "code": code, "help": out.getvalue()}), flush=True)
"""


@functools.cache
def script_help() -> dict[str, dict[str, object]]:
    """{script file name: {"code": exit code or traceback, "help": its --help text}} for every script."""
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, *map(str, SCRIPTS)],
        capture_output=True, text=True, timeout=300, check=False, cwd=BENCH.parent,
        env={**os.environ, "PYTHONPATH": f"{BENCH}{os.pathsep}{BENCH.parent}"},
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"script"')]
    found = {Path(r["script"]).name: r for r in lines}
    if set(found) != {p.name for p in SCRIPTS}:
        raise AssertionError(f"the --help child stopped early:\n{proc.stderr[-3000:]}")
    return found


def dry_run(script: str, work: Path, timeout: float = 900) -> list[dict[str, Any]]:
    """`bench/<script> --dry-run --work WORK` (the loss left uncompiled: compiling costs more than a few
    toy steps save); its JSON lines. A failed run fails the test with its stderr's tail."""
    env = {**os.environ, "PEAGLE_COMPILE": "0"}
    run = subprocess.run(
        [sys.executable, script, "--dry-run", "--work", str(work)],
        cwd=BENCH, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def bench_module(name: str) -> Any:
    """bench/<name>.py imported as a module (bench/ is a folder of scripts whose siblings import each other
    by bare name, so it is on sys.path for the import)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
