"""Server paths out of what a project sees: absolute paths in event and error text keep only their last part.

Events and job errors are shown to the project over the API; the directories behind them (the data dir,
scratch, the artifact store, other projects' caches) are the operator's business, never the client's.
"""

from __future__ import annotations

import re
from typing import Any

# An absolute POSIX path, not part of a URL (`s3://b/k`), a relative path (`a/b`, `./a`), a ratio (`3/10`)
# or an already redacted `<server>/x` (errors are redacted where raised and again where stored). After a
# dotted field path (`spec./srv/x`: a client's key in error.param) it is a path again.
_ABS_PATH = re.compile(r"(?:(?<![\w:/.~>-])|(?<=\w\.))/(?:[^\s/'\"`]+/)*([^\s/'\"`,;:)\]]+)")


def redact_paths(value: Any) -> Any:
    """`value` with every absolute path in its strings (recursively in lists and dicts) replaced by
    `<server>/<last part>`."""
    if isinstance(value, str):
        return _ABS_PATH.sub(lambda m: f"<server>/{m.group(1)}", value)
    if isinstance(value, dict):
        return {k: redact_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_paths(v) for v in value]
    return value
