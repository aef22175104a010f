"""The job editor's checks: YAML text -> JobSpec, every problem tied to its dotted field and YAML line.

Validation is the API's own: `peagle_core.spec.parse_spec` (the JobSpec model whose JSON schema the API
publishes) and the server-path rules of `service.paths`, so the editor accepts exactly what
`POST /v1/jobs` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from peagle_core.spec import JobSpec, SpecError, parse_spec
from service.paths import check_spec_paths
from service.settings import Settings

MAX_SPEC_CHARS = 64 * 1024


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


def errors_at_lines(text: str, errors: list[tuple[str, str]]) -> list[FieldError]:
    """(param, message) pairs as FieldErrors with the line of each field in `text`."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        root = None
    out = []
    for param, message in errors:
        param = param.removeprefix("spec.")
        out.append(FieldError(param, message, _node_line(root, param)))
    return out


def parse_yaml(text: str) -> tuple[dict[str, Any] | None, list[FieldError]]:
    """The YAML document as a dict, or the syntax error at its line."""
    if len(text) > MAX_SPEC_CHARS:
        return None, [FieldError("", f"the spec is longer than {MAX_SPEC_CHARS} characters", None)]
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        return None, [FieldError("", f"invalid YAML: {problem}", mark.line + 1 if mark else None)]
    if not isinstance(data, dict):
        return None, [FieldError("", "a job spec is a YAML mapping (verifier:, dataset:, ...)", 1)]
    return data, []


def check(
    text: str, settings: Settings, project_id: str | None = None
) -> tuple[JobSpec | None, list[FieldError]]:
    """Parse and validate the editor's text as the API would (the project's own paths included);
    (spec with normalised paths, []) or (None, errors)."""
    data, errors = parse_yaml(text)
    if data is None:
        return None, errors
    try:
        spec = check_spec_paths(parse_spec(data), settings, prefix="", project_id=project_id)
    except SpecError as exc:
        return None, errors_at_lines(text, exc.errors)
    return spec, []


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
