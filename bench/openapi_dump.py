"""Dump a tree's /openapi.json, or compare two dumps: which component schemas were renamed, added or dropped,
and whether operation ids and the schemas' bodies (names aside) stayed the same.

    python bench/openapi_dump.py dump > /tmp/after.json                 # this checkout
    python bench/openapi_dump.py dump --root /tmp/old > /tmp/before.json  # e.g. `git worktree add /tmp/old <rev>`
    python bench/openapi_dump.py diff /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Run in a child process of the dumped tree, so `--root` measures that tree's code, not this one's.
_DUMP = """
import json, sys
from service.app import create_app
from service.settings import Settings
app = create_app(Settings(data_dir=sys.argv[1], redis_url="redis://127.0.0.1:1/0"))
print(json.dumps(app.openapi(), indent=1, sort_keys=True))
"""


def dump(root: Path) -> str:
    """`root`'s OpenAPI document as sorted, indented JSON (the app is built, never served or connected)."""
    with tempfile.TemporaryDirectory() as data_dir:
        done = subprocess.run(
            [sys.executable, "-c", _DUMP, data_dir],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stdout


def _renamed_refs(doc: Any, names: dict[str, str]) -> Any:
    """`doc` with each `#/components/schemas/<old>` reference (and title) spelled with its new name."""
    if isinstance(doc, dict):
        return {k: _renamed_refs(v, names) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_renamed_refs(v, names) for v in doc]
    if isinstance(doc, str) and doc.startswith("#/components/schemas/"):
        old = doc.removeprefix("#/components/schemas/")
        return "#/components/schemas/" + names.get(old, old)
    return doc


def _operation_ids(doc: dict[str, Any]) -> list[str]:
    return sorted(
        op["operationId"] for ops in doc["paths"].values() for op in ops.values() if "operationId" in op
    )


def _without_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_titles(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_without_titles(v) for v in schema]
    return schema


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Component renames (a schema gone and one come whose bodies match, titles and refs aside), the rest
    added or dropped, and whether operation ids and everything else are unchanged once renames are undone."""
    old, new = before["components"]["schemas"], after["components"]["schemas"]
    gone, came = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    renames: dict[str, str] = {}
    for _ in range(len(gone)):  # a renamed schema may refer to another renamed one: settle in rounds
        for name in gone:
            body = _without_titles(_renamed_refs(old[name], renames))
            match = [n for n in came if n not in renames.values() and _without_titles(new[n]) == body]
            if len(match) == 1:
                renames[name] = match[0]
    undone = _renamed_refs(before, renames)
    undone["components"]["schemas"] = {
        renames.get(k, k): v for k, v in undone["components"]["schemas"].items()
    }
    return {
        "renamed": renames,
        "dropped": [n for n in gone if n not in renames],
        "added": [n for n in came if n not in renames.values()],
        "operation_ids_unchanged": _operation_ids(before) == _operation_ids(after),
        "same_but_names": _without_titles(undone) == _without_titles(after),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    dump_cmd = sub.add_parser("dump", help="print a tree's OpenAPI document")
    dump_cmd.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    diff_cmd = sub.add_parser("diff", help="compare two dumps")
    diff_cmd.add_argument("before", type=Path)
    diff_cmd.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        sys.stdout.write(dump(args.root.resolve()))
    else:
        before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
        print(json.dumps(diff(before, after), indent=1))


if __name__ == "__main__":
    main()
