"""Bodies sent wrong are told what to fix (issue 44, classes 4 and 5): the wrong Content-Type on any JSON or
form route is a 415 naming the header, and malformed multipart framing (a boundary RFC 2046 does not
allow, broken part headers) is a 400 naming the problem on every multipart door, never a 500. The routes
are taken from the app itself, so a route added later is covered too."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.routing import APIRoute

from service.api.body_route import BodyRoute, body_kind
from tests.service.ui.test_ui import csrf_of, sign_in

GOOD = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})


def _routes(app: Any, kind: str) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and body_kind(route) == kind:
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            out.extend((method, path) for method in sorted(route.methods))
    return out


def test_every_route_checks_its_body(app) -> None:
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert routes and all(isinstance(r, BodyRoute) for r in routes), [
        r.path for r in routes if not isinstance(r, BodyRoute)
    ]
    assert ("POST", "/v1/jobs") in _routes(app, "json") and ("POST", "/v1/jobs/plan") in _routes(app, "json")
    assert ("POST", "/ui/jobs/new") in _routes(app, "form")


def _unsupported(r: Any, expected: str) -> None:
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_media_type", "Content-Type"), error
    assert expected in error["message"], error


def test_json_routes_answer_415_for_another_content_type(app, client, auth, spec) -> None:
    body = json.dumps({"spec": spec})
    for method, path in _routes(app, "json"):
        for ctype in [
            "application/x-www-form-urlencoded",
            "text/plain",
            None,
            "multipart/form-data; boundary=b",
        ]:
            headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
            _unsupported(client.request(method, path, content=body, headers=headers), "application/json")
        # The same body as JSON is taken.
        ok = client.request(method, path, content=body, headers={**auth, "Content-Type": "application/json"})
        assert ok.status_code in (201, 202), ok.text


def test_form_routes_answer_415_for_json(app, client, api_key) -> None:
    sign_in(client, api_key)
    for method, path in _routes(app, "form"):
        r = client.request(method, path, json={"csrf_token": "x"})
        _unsupported(r, "application/x-www-form-urlencoded")


def _multipart(boundary: str, part: bytes = b"") -> bytes:
    part = part or (
        b'Content-Disposition: form-data; name="file"; filename="d.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + GOOD.encode() + b"\n"
    )
    b = boundary.encode()
    return b"--" + b + b"\r\n" + part + b"\r\n--" + b + b"--\r\n"


@pytest.fixture
def upload_doors(client, auth, api_key) -> list[tuple[str, dict[str, str]]]:
    sign_in(client, api_key)
    csrf = csrf_of(client, "/ui/datasets")
    return [("/v1/datasets", auth), ("/ui/data/datasets", {"X-CSRF-Token": csrf})]


BAD_BOUNDARIES = [
    ("b" * 71, "71 characters long; RFC 2046 allows 1 to 70"),
    ("b" * 500, "500 characters long"),
    ("", "0 characters long"),
    ("bad\\boundary", "character RFC 2046 does not allow"),
    ("ends-with-space ", "character RFC 2046 does not allow"),
]


def test_a_boundary_rfc_2046_does_not_allow_is_a_400_on_every_multipart_door(client, upload_doors) -> None:
    doors = [*upload_doors, ("/ui/login", {})]  # a form route: Starlette's parser
    for boundary, needle in BAD_BOUNDARIES:
        for path, headers in doors:
            ctype = f'multipart/form-data; boundary="{boundary}"'
            r = client.post(path, content=_multipart(boundary), headers={**headers, "Content-Type": ctype})
            assert r.status_code == 400, (path, boundary, r.text)
            error = r.json()["error"]
            assert error["code"] == "malformed_body" and needle in error["message"], (path, error)


def test_a_70_character_boundary_is_taken(client, upload_doors) -> None:
    boundary = "b" * 70
    for path, headers in upload_doors:
        ctype = f"multipart/form-data; boundary={boundary}"
        r = client.post(path, content=_multipart(boundary), headers={**headers, "Content-Type": ctype})
        assert r.status_code == 201, (path, r.text)


def test_a_missing_boundary_is_a_400_naming_it(client, upload_doors) -> None:
    for path, headers in [*upload_doors, ("/ui/login", {})]:
        r = client.post(
            path, content=_multipart("b"), headers={**headers, "Content-Type": "multipart/form-data"}
        )
        assert r.status_code == 400 and "no boundary" in r.json()["error"]["message"], (path, r.text)


BROKEN_PARTS = [
    b"Content-Disposition form-data\r\n\r\ndata",  # a header line without its colon
    b'Content-Disposition: form-data; name="file"\r\nX' + b"h" * 20000 + b": v\r\n\r\ndata",  # too long
]


def test_broken_part_headers_are_a_400_naming_the_problem(client, upload_doors) -> None:
    for part in BROKEN_PARTS:
        for path, headers in [*upload_doors, ("/ui/login", {})]:
            ctype = "multipart/form-data; boundary=xyz"
            r = client.post(path, content=_multipart("xyz", part), headers={**headers, "Content-Type": ctype})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "malformed_body", error
            assert error["message"].startswith("malformed multipart body: "), error
            assert len(error["message"]) > len("malformed multipart body: invalid multipart data."), error
