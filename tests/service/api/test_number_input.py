"""Numbers beyond the parsers: integers past Python's 4300-digit conversion limit, floats that overflow,
NaN and infinities, and nesting past the parser's depth, in JSON bodies, the dashboard's YAML spec, spec
files and JSONL uploads. Each is a 422 (or the editor's inline error) naming the field or the line,
never a 400 without a field or a 500."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from peagle_core.spec import SpecError, load_spec
from tests.service.ui.test_ui import csrf_of, sign_in

HUGE = "9" * 5000
# (field, literal) pairs: what a client can write in a JSON body where the spec wants a number.
NUMBERS = [
    ("training.seed", HUGE),
    ("training.seed", "-" + HUGE),
    ("training.max_steps", HUGE),
    ("dataset.seq_len", HUGE),
    ("model.num_layers", HUGE),
    ("resources.nodes", HUGE),
    ("evaluation.prompts", HUGE),
    ("training.lr", HUGE),
    ("training.lr", "1e999"),
    ("training.lr", "-1e999"),
    ("training.lr", "NaN"),
    ("training.lr", "Infinity"),
    ("training.lr", "-Infinity"),
    ("training.seed", "1e999"),
    ("training.seed", "NaN"),
    ("dataset.val_fraction", "1" + "0" * 400 + ".5"),
    ("name", HUGE),
]


MARKER = "__NUMBER__"


def _marked(spec: dict[str, Any], field: str) -> dict[str, Any]:
    """A copy of `spec` holding MARKER at the dotted `field` (for a literal to be written in its place)."""
    doc = json.loads(json.dumps(spec))
    *parents, leaf = field.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = MARKER
    return doc


def _body_with(spec: dict[str, Any], field: str, literal: str) -> bytes:
    """The JSON body `{"spec": spec}` with `literal` written verbatim at `field`."""
    return json.dumps({"spec": _marked(spec, field)}).replace(f'"{MARKER}"', literal).encode()


@pytest.mark.parametrize(("field", "literal"), NUMBERS, ids=[f"{f}={v[:12]}" for f, v in NUMBERS])
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/jobs/plan"])
def test_json_numbers_beyond_a_field_are_422_naming_it(client, auth, spec, route, field, literal) -> None:
    body = _body_with(spec, field, literal)
    r = client.post(route, content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    # A union field's error names the member too (`spec.evaluation.prompts.int`).
    assert error["param"] == f"spec.{field}" or error["param"].startswith(f"spec.{field}."), error
    if literal.lstrip("-") == HUGE:
        assert "5000 digits" in error["message"], error


@pytest.mark.parametrize("depth", [2000, 100_000])
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/jobs/plan"])
def test_json_nested_past_the_parser_is_422_naming_the_body(client, auth, route, depth) -> None:
    body = b'{"spec": ' + b"[" * depth + b"]" * depth + b"}"
    r = client.post(route, content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] in ("body", "spec"), r.text


YAML_NUMBERS = [
    ("training.seed", HUGE),
    ("training.seed", "-" + HUGE),
    ("training.seed", "0x" + "f" * 5000),
    ("training.lr", ".inf"),
    ("training.lr", "-.inf"),
    ("training.lr", ".nan"),
    ("training.lr", "1.0e999"),
    ("dataset.seq_len", HUGE),
]


def _yaml_with(spec: dict[str, Any], field: str, literal: str) -> str:
    return yaml.safe_dump(_marked(spec, field), sort_keys=False, width=1 << 20).replace(MARKER, literal)


@pytest.mark.parametrize(("field", "literal"), YAML_NUMBERS, ids=[f"{f}={v[:8]}" for f, v in YAML_NUMBERS])
def test_yaml_numbers_beyond_a_field_are_shown_at_the_field(client, api_key, spec, field, literal) -> None:
    sign_in(client, api_key)
    text = _yaml_with(spec, field, literal)
    form = {"spec_yaml": text, "csrf_token": csrf_of(client, "/ui/jobs/new"), "action": "validate"}
    r = client.post("/ui/jobs/new", data=form)
    assert r.status_code == 200, r.text
    assert f'data-param="{field}"' in r.text and 'id="resolved"' not in r.text


@pytest.mark.parametrize(("field", "literal"), YAML_NUMBERS, ids=[f"{f}={v[:8]}" for f, v in YAML_NUMBERS])
def test_spec_files_name_the_field_too(tmp_path: Path, spec, field, literal) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(_yaml_with(spec, field, literal))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.param == field


def test_yaml_nested_past_the_parser_is_an_error_not_a_500(client, api_key) -> None:
    sign_in(client, api_key)
    text = "a: " + "[" * 20000 + "]" * 20000
    form = {"spec_yaml": text, "csrf_token": csrf_of(client, "/ui/jobs/new"), "action": "validate"}
    r = client.post("/ui/jobs/new", data=form)
    assert r.status_code == 200 and 'role="alert"' in r.text, r.text[:500]


GOOD = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
LINES = {
    "huge-int-token": b'{"input_ids": [' + HUGE.encode() + b'], "loss_mask": [1]}',
    "huge-int-extra": GOOD[:-1] + b', "n": -' + HUGE.encode() + b"}",
    "float-overflow": GOOD[:-1] + b', "w": 1e999}',
    "nan": GOOD[:-1] + b', "w": NaN}',
    "infinity": GOOD[:-1] + b', "w": Infinity}',
    "-infinity": GOOD[:-1] + b', "w": -Infinity}',
    "token-past-int32": b'{"input_ids": [4294967296], "loss_mask": [1]}',
    "deep": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("line", list(LINES.values()), ids=list(LINES))
def test_jsonl_numbers_beyond_the_parser_are_422_naming_the_line(client, auth, line) -> None:
    tokenized = line.startswith(b'{"input_ids"')
    first = b'{"input_ids": [1, 2], "loss_mask": [0, 1]}' if tokenized else GOOD
    body = first + b"\n" + line + b"\n"
    r = client.post("/v1/datasets", files={"file": ("d.jsonl", body)}, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "file" and error["message"].startswith("line 2:"), error
