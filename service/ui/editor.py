"""The job editor's checks: YAML text -> JobSpec, every problem tied to its dotted field and YAML line.

Validation is the API's own: `peagle_core.spec.parse_spec` (the JobSpec model whose JSON schema the API
publishes) and `service.api.admission.admit_spec` (server paths, queues, trackers, the size cap), so the
editor accepts exactly what `POST /v1/jobs` accepts. The YAML is capped by what it decodes to (aliases
expanded), as a JSON body is: 64 KiB of text may not stand for megabytes of spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from peagle_core.documents import DocumentError, load_yaml
from peagle_core.spec import JobSpec, SpecError, parse_spec
from service.api.admission import admit_spec
from service.api.doc_size import bounded_yaml_loader, check_spec_size
from service.api.errors import ApiError
from service.settings import Settings

MAX_SPEC_CHARS = 64 * 1024
# The page lists (and locates) this many problems; a spec with thousands shows their count and these.
MAX_SHOWN_ERRORS = 50
# libyaml's parser when PyYAML has it: several times faster than the pure-Python one on a 64 KiB spec.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class FieldError:
    param: str  # dotted field in the spec ("training.lr"); "" for the document itself
    message: str
    line: int | None  # 1-based line in the YAML text


def _node_line(root: yaml.Node | None, param: str) -> int | None:
    """The line of the key `param` names, or of its nearest existing parent."""
    if root is None:
        return None
    node, line = root, root.start_mark.line + 1
    for part in [p for p in param.split(".") if p]:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if match is None:
                return line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            return line
    return line


class FieldErrors(list[FieldError]):
    """The first `MAX_SHOWN_ERRORS` problems, `total` (how many there were) and `by_line` (line -> the
    first message there, for the gutter): rendering is linear in the text, whatever the error count."""

    def __init__(self, shown: list[FieldError], total: int | None = None):
        super().__init__(shown)
        self.total = len(shown) if total is None else total
        self.by_line: dict[int, str] = {}
        for e in shown:
            if e.line is not None:
                self.by_line.setdefault(e.line, e.message)


def errors_at_lines(text: str, errors: list[tuple[str, str]]) -> FieldErrors:
    """(param, message) pairs as FieldErrors with the line of each field in `text`; only the first
    `MAX_SHOWN_ERRORS` are located (each lookup walks the YAML tree), the rest only counted."""
    if not errors:
        return FieldErrors([])
    try:
        root = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError:
        root = None
    out = []
    for param, message in errors[:MAX_SHOWN_ERRORS]:
        param = "" if param == "spec" else param.removeprefix("spec.")
        out.append(FieldError(param, message, _node_line(root, param)))
    return FieldErrors(out, total=len(errors))


def parse_yaml(text: str, max_bytes: int) -> tuple[dict[str, Any] | None, FieldErrors]:
    """The YAML document as a dict, or the syntax error at its line, or the cap it passes once its
    aliases are expanded (`max_bytes` as JSON, the API's PEAGLE_MAX_SPEC_BYTES)."""
    if len(text) > MAX_SPEC_CHARS:
        return None, FieldErrors(
            [FieldError("", f"the spec is longer than {MAX_SPEC_CHARS} characters", None)]
        )
    try:
        # A safe loader (CSafeLoader or SafeLoader) that measures the composed document before it builds
        # anything, then the API's own measure of what it built.
        data = load_yaml(text, bounded_yaml_loader(_LOADER, max_bytes))
        check_spec_size(data, max_bytes)
    except DocumentError as exc:
        return None, FieldErrors([FieldError("", str(exc), None)])
    except ApiError as exc:
        return None, FieldErrors([FieldError("", exc.message, None)])
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        return None, FieldErrors(
            [FieldError("", f"invalid YAML: {problem}", mark.line + 1 if mark else None)]
        )
    if not isinstance(data, dict):
        return None, FieldErrors(
            [FieldError("", "a job spec is a YAML mapping (verifier:, dataset:, ...)", 1)]
        )
    return data, FieldErrors([])


def check(text: str, settings: Settings, project_id: str | None = None) -> tuple[JobSpec | None, FieldErrors]:
    """Parse and validate the editor's text as the API would (the project's own paths and the server's
    queues included); (spec with normalised paths, []) or (None, errors)."""
    data, errors = parse_yaml(text, settings.max_spec_bytes)
    if data is None:
        return None, errors
    try:
        spec = admit_spec(parse_spec(data), settings, project_id, prefix="")
    except SpecError as exc:
        return None, errors_at_lines(text, exc.errors)
    except ApiError as exc:
        return None, errors_at_lines(text, [(exc.param or "", exc.message)])
    return spec, FieldErrors([])


def template(dataset_id: str | None) -> str:
    """The editor's starting text: the required fields and a small training budget."""
    return f"""\
name: my-drafter
verifier:
  name_or_path: ""        # a model directory under the server's allowed roots, or a hub id
dataset:
  id: {dataset_id or '""'}        # an uploaded dataset (Datasets page)
  seq_len: 2048
model:
  num_depths: 4
training:
  epochs: 1
  lr: 6.0e-4
tracking:
  report_to: []           # tensorboard, mlflow
"""
