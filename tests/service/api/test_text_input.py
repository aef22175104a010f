"""Strings the stores cannot hold are refused at the edge, naming the field, header, parameter or line:
every string field of the job spec, the stored headers, path and query parameters, dataset rows and
upload file names. Runs on SQLite and Postgres (Postgres cannot store NUL: these were its 500s)."""

from __future__ import annotations

import copy
import json
import re
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from peagle_core.spec import JobSpec
from tests.service.conftest import create_job

NUL, SURROGATE, ESCAPE, DEL_C1 = "a\x00b", "a\ud800b", "a\x1b[31mb", "a\x85b"
LONG = "x" * 70_000
# Every string field of the spec (a dotted path; `[0]` is a list item) and how a spec carries it.
SPEC_STRINGS = [
    "name",
    "verifier.name_or_path",
    "verifier.revision",
    "dataset.id",
    "dataset.path",
    "hidden_states.cache_uri",
    "model.init_from",
    "evaluation.prompts[0]",
    "evaluation.prompts[0].prompt",
    "evaluation.prompts[0].category",
    "resources.queue",
    "resources.nodes",
]
FREE_TEXT = {"evaluation.prompts[0]", "evaluation.prompts[0].prompt"}


def _string_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted paths of every field of `model` (and its nested models) that can hold a `str`."""
    out: set[str] = set()

    def walk(annotation: Any, path: str) -> None:
        origin = typing.get_origin(annotation)
        if annotation is str:
            out.add(path)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_string_fields(annotation, f"{path}."))
        elif origin is typing.Annotated:
            walk(typing.get_args(annotation)[0], path)
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(annotation):
                walk(arg, path)
        elif origin is list:
            walk(typing.get_args(annotation)[0], f"{path}[0]")

    for name, field in model.model_fields.items():
        walk(field.annotation, f"{prefix}{name}")
    return out


def test_the_cases_cover_every_string_field_of_the_spec() -> None:
    assert _string_fields(JobSpec) == set(SPEC_STRINGS)


def _with(spec: dict[str, Any], path: str, value: str) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    if path.startswith("dataset.id"):
        out["dataset"].pop("path")
    if path.startswith("evaluation.prompts[0]."):
        out["evaluation"] = {"prompts": [{"prompt": "p", path.rsplit(".", 1)[1]: value}]}
        return out
    if path == "evaluation.prompts[0]":
        out["evaluation"] = {"prompts": [value]}
        return out
    *parents, leaf = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _post_json(client: Any, url: str, body: Any, headers: dict[str, str]) -> Any:
    # ensure_ascii: a lone surrogate travels as the JSON escape a client sends (it has no UTF-8 bytes).
    content = json.dumps(body).encode()
    return client.post(url, content=content, headers={**headers, "Content-Type": "application/json"})


def _refused(r: Any, param: str | None = None, *, startswith: str | None = None) -> dict[str, Any]:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if startswith is not None:
        assert (error["param"] or "").startswith(startswith), error
    return error


BAD_STRINGS = {"nul": NUL, "surrogate": SURROGATE, "esc": ESCAPE, "c1": DEL_C1, "long": LONG}
# Free text (a prompt) may hold control characters (`test_prompts_keep_what_a_model_may_see`).
SPEC_CASES = [
    pytest.param(field, bad, id=f"{field}-{name}")
    for field in SPEC_STRINGS
    for name, bad in BAD_STRINGS.items()
    if not (field in FREE_TEXT and bad in (ESCAPE, DEL_C1))
]


@pytest.mark.parametrize(("field", "bad"), SPEC_CASES)
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/jobs/plan"])
def test_unstorable_spec_strings_are_422_naming_the_field(client, auth, spec, route, field, bad) -> None:
    r = _post_json(client, route, {"spec": _with(spec, field, bad)}, auth)
    prefix = "spec." + field.split("[")[0]
    error = _refused(r, startswith=prefix)
    assert "\x00" not in r.text and "\\ud800" not in error["message"]


@pytest.mark.parametrize("text", ["tab\there", "two\nlines", "emoji \U0001f600 and \u202e rtl", "\x1b[1m"])
def test_prompts_keep_what_a_model_may_see(client, auth, spec, text) -> None:
    job = create_job(client, auth, {**spec, "evaluation": {"prompts": [text, {"prompt": text}]}})
    assert job["spec"]["evaluation"]["prompts"][0] == text


@pytest.mark.parametrize(
    "key", [NUL, ESCAPE, "a\nb", DEL_C1, "k" * 256], ids=["nul", "esc", "newline", "c1", "long"]
)
def test_a_bad_idempotency_key_is_422_naming_the_header(client, auth, spec, key) -> None:
    r = client.post(
        "/v1/jobs", json={"spec": spec}, headers={**auth, "Idempotency-Key": key.encode("latin-1")}
    )
    _refused(r, "Idempotency-Key")


def test_a_json_key_with_a_lone_surrogate_is_refused_and_the_answer_encodes(client, auth, spec) -> None:
    r = _post_json(client, "/v1/jobs", {"spec": {**spec, "x\ud800": 1}}, auth)
    # pydantic refuses the key itself, in the object holding it; the refusal is valid UTF-8 JSON.
    assert _refused(r)["param"] == "spec"


def _route_parameters() -> list[tuple[str, str, str, str]]:
    """(method, path template, parameter, "path" | "query") for every parameter of every route."""
    from fastapi.dependencies.utils import get_flat_dependant
    from fastapi.routing import APIRoute

    from service.app import create_app
    from service.settings import Settings

    # Building the app connects to nothing: its routes are all this needs.
    app = create_app(Settings(database_url="sqlite://", data_dir="/nonexistent/peagle-test"))
    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        flat = get_flat_dependant(route.dependant)
        for method in sorted(route.methods):
            out += [(method, route.path, p.name, "path") for p in flat.path_params]
            out += [(method, route.path, p.alias, "query") for p in flat.query_params]
            out.append((method, route.path, "unknown", "query"))  # a parameter no route declares
    return out


ROUTE_PARAMETERS = _route_parameters()


def test_the_route_cases_cover_the_known_parameters() -> None:
    names = {(path, name) for _, path, name, _ in ROUTE_PARAMETERS}
    assert {("/v1/jobs", "after"), ("/v1/jobs/{job_id}", "job_id"), ("/ui/login", "next")} <= names


@pytest.mark.parametrize(
    ("method", "path", "param", "kind"),
    ROUTE_PARAMETERS,
    ids=[f"{m} {p} {n}" for m, p, n, _ in ROUTE_PARAMETERS],
)
def test_path_and_query_strings_are_422_naming_the_parameter(client, auth, method, path, param, kind) -> None:
    from urllib.parse import quote

    # Every class of bad name in one test per parameter: an app and a key per case would cost minutes.
    for bad in (NUL, ESCAPE, DEL_C1, "x" * 5000):
        value = quote(bad, safe="")
        url = re.sub(
            r"{(\w+)(:\w+)?}", lambda m, v=value: v if kind == "path" and m.group(1) == param else "x", path
        )
        if kind == "query":
            url += f"?{param}={value}"
        _refused(client.request(method, url, headers=auth), param)


def test_the_sse_resume_header_refuses_control_characters(client, auth, spec) -> None:
    job = create_job(client, auth, spec)
    headers = {**auth, "Accept": "text/event-stream", "Last-Event-ID": "1\x00"}
    _refused(client.get(f"/v1/jobs/{job['id']}/events", headers=headers), "Last-Event-ID")


def _line(content: str, role: str = "assistant", key: str = "content") -> bytes:
    row = {"messages": [{"role": "user", "content": "q"}, {"role": role, key: content}]}
    return json.dumps(row).encode()  # ensure_ascii: NUL and surrogates as the escapes a file holds


GOOD = _line("a")


def _sharegpt(value: str) -> bytes:
    return json.dumps(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": value}]}
    ).encode()


@pytest.mark.parametrize(
    ("first", "line"),
    [
        (GOOD, _line(NUL)),
        (GOOD, _line(SURROGATE)),
        (GOOD, _line("\udfff alone")),
        (GOOD, json.dumps({"messages": [{"role": "user", "content": "q", "n\x00te": "x"}]}).encode()),
        (_sharegpt("a"), _sharegpt(NUL)),
    ],
    ids=["nul", "surrogate", "low-surrogate", "nul-in-key", "sharegpt-nul"],
)
def test_dataset_lines_with_unstorable_text_are_422_naming_the_line(client, auth, first, line) -> None:
    body = first + b"\n" + line + b"\n"
    r = client.post("/v1/datasets", files={"file": ("d.jsonl", body)}, headers=auth)
    error = _refused(r, "file")
    assert "line 2" in error["message"], error


@pytest.mark.parametrize(
    "content", ["tab\tand\nnewline", "\u202eright-to-left", "\U0001f600 emoji", "\x1b[1mbold\x7f", "\u0085"]
)
def test_dataset_text_a_model_may_see_is_kept(client, auth, content) -> None:
    r = client.post("/v1/datasets", files={"file": ("d.jsonl", _line(content) + b"\n")}, headers=auth)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    "name", [b"a\x00b.jsonl", b"a\x1bb.jsonl", b"a\x7f.jsonl"], ids=["nul", "esc", "del"]
)
def test_an_upload_file_name_with_control_characters_is_422(client, auth, name) -> None:
    boundary = "XyZ"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
        + name
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        + GOOD
        + f"\n\r\n--{boundary}--\r\n".encode()
    )
    headers = {**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    _refused(client.post("/v1/datasets", content=body, headers=headers), "file")
