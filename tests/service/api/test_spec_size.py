"""A spec is capped by what it decodes to (issue 44, class 1): YAML aliases count as what they expand to,
on every door that takes a spec (the API's create and plan, the dashboard's Submit and Validate), and no
stored job row holds more than the cap; an Idempotency-Key replay does not get around it."""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from sqlalchemy import select

from service.db.models import Job
from service.db.session import session_factory
from tests.service.ui.test_ui import csrf_of, sign_in

ANCHOR_CHARS = 32 * 1024
ALIASES = 1000
CAP_MESSAGE = "once decoded"


def alias_spec_yaml(spec: dict[str, Any], aliases: int = ALIASES, chars: int = ANCHOR_CHARS) -> str:
    """`spec` as YAML whose evaluation prompts are `aliases` aliases of one `chars`-long anchor: about
    40 KB of text for 32 MB of spec, as the probe sent."""
    text = yaml.safe_dump(spec, sort_keys=False)
    refs = ", ".join(["*p"] * (aliases - 1))
    return text + f'evaluation:\n  prompts: [&p "{"x" * chars}", {refs}]\n'


@pytest.fixture
def ui(client: Any, api_key: str) -> Any:
    sign_in(client, api_key)
    return client


def _editor(ui: Any, text: str, action: str) -> Any:
    form = {
        "spec_yaml": text,
        "action": action,
        "idempotency_key": "",
        "csrf_token": csrf_of(ui, "/ui/jobs/new"),
    }
    return ui.post("/ui/jobs/new", data=form, follow_redirects=False)


def _refused_in_editor(r: Any, needle: str = CAP_MESSAGE) -> None:
    assert r.status_code == 200 and 'role="alert"' in r.text, (r.status_code, r.text[:300])
    assert needle in html.unescape(r.text), r.text[:2000]


def _job_count(db_url: str) -> int:
    with session_factory(db_url)() as s:
        return len(list(s.scalars(select(Job.id))))


def test_alias_expanded_spec_over_the_cap_is_refused_on_every_door(ui, auth, spec, db_url) -> None:
    text = alias_spec_yaml(spec)
    assert len(text) < 48 * 1024  # the probe's ~40 KB of YAML ...
    expanded = yaml.load(text, Loader=yaml.CSafeLoader)
    assert len(expanded["evaluation"]["prompts"]) == ALIASES  # ... for 1000 prompts of 32 KB each
    before = _job_count(db_url)
    for action in ("submit", "validate"):
        r = _editor(ui, text, action)
        _refused_in_editor(r)
        assert "PEAGLE_MAX_SPEC_BYTES" in r.text
        # The page echoes the 40 KB text, never the 32 MB expansion (Validate answered a 32 MB page).
        assert len(r.content) < 512 * 1024
    # The same spec as JSON, to the API's create and plan.
    for route in ("/v1/jobs", "/v1/jobs/plan"):
        r = ui.post(route, json={"spec": expanded}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text[:300]
    assert _job_count(db_url) == before


@pytest.fixture
def small_cap(make_settings: Any, redis_conn: Any, api_key: str) -> Iterator[Any]:
    """A client on an app whose spec cap is 4 KiB, signed in to the dashboard too."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    app = create_app(make_settings(max_spec_bytes=4096))
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        sign_in(c, api_key)
        yield c


def _under_the_wire_over_the_cap(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec whose request body is under 4 KiB but which, with its defaults filled in (what a job row
    stores), is over it."""
    body = {**spec, "evaluation": {"prompts": ["p" * 900] * 3}}
    assert len(json.dumps({"spec": body})) < 4096
    return body


def test_the_api_caps_the_spec_as_stored_not_only_the_body(small_cap, auth, spec) -> None:
    for route in ("/v1/jobs", "/v1/jobs/plan"):
        r = small_cap.post(route, json={"spec": _under_the_wire_over_the_cap(spec)}, headers=auth)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("payload_too_large", "spec"), error
        assert CAP_MESSAGE in error["message"], error
        assert small_cap.post(route, json={"spec": spec}, headers=auth).status_code in (201, 202)


def test_aliases_within_the_cap_are_accepted_and_stored_expanded(small_cap, spec, db_url) -> None:
    r = _editor(small_cap, alias_spec_yaml(spec, aliases=3, chars=20), "submit")
    assert r.status_code == 303, r.text[:2000]
    job_id = r.headers["location"].rsplit("/", 1)[1]
    with session_factory(db_url)() as s:
        job = s.get(Job, job_id)
        assert job.spec["evaluation"]["prompts"] == ["x" * 20] * 3
        for stored in (job.spec, job.spec_submitted):
            assert len(json.dumps(stored, separators=(",", ":")).encode()) <= 4096
    # Four times as many aliases pass the cap only once expanded: refused at both of the editor's buttons.
    for action in ("validate", "submit"):
        _refused_in_editor(_editor(small_cap, alias_spec_yaml(spec, aliases=12, chars=400), action))


def test_merge_key_amplification_is_refused_before_it_is_built(ui, spec) -> None:
    """Merge keys (`<<`) copy a mapping's entries while the document is built: nine levels of ten merges
    would be 10^9 entries, for a document that dedups to a few keys. Refused from the composed document,
    before anything is constructed."""
    lines = ["base: &l0 {" + ", ".join(f"k{i}: {i}" for i in range(10)) + "}"]
    for level in range(1, 10):
        merges = ", ".join([f"*l{level - 1}"] * 10)
        lines.append(f"m{level}: &l{level} {{<<: [{merges}]}}")
    text = yaml.safe_dump(spec, sort_keys=False) + "\n".join(lines) + "\n"
    _refused_in_editor(_editor(ui, text, "validate"))


def test_a_recursive_alias_is_refused_naming_it(ui, spec) -> None:
    text = yaml.safe_dump(spec, sort_keys=False) + "evaluation: &e\n  prompts: [*e]\n"
    _refused_in_editor(_editor(ui, text, "validate"), "contains itself")


def test_an_idempotency_replay_does_not_get_around_the_cap_or_the_content_type(small_cap, auth, spec) -> None:
    key = {"Idempotency-Key": "replay-44"}
    first = small_cap.post("/v1/jobs", json={"spec": spec}, headers={**auth, **key})
    assert first.status_code == 201, first.text
    over = small_cap.post(
        "/v1/jobs", json={"spec": _under_the_wire_over_the_cap(spec)}, headers={**auth, **key}
    )
    assert over.status_code == 413, over.text
    wrong = small_cap.post(
        "/v1/jobs", content=json.dumps({"spec": spec}), headers={**auth, **key, "Content-Type": "text/plain"}
    )
    assert wrong.status_code == 415, wrong.text
    again = small_cap.post("/v1/jobs", json={"spec": spec}, headers={**auth, **key})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


@pytest.mark.parametrize(
    "value",
    [{}, [], "é\n\x00", {"a": [1, -2, 2.5, None, True, False, 'q"\\']}, {1: 2, None: False}, [[{}]] * 3],
)
def test_json_size_is_the_compact_json_size(value) -> None:
    from service.api.doc_size import _expanded_size, _value_children, _value_size, json_size

    exact = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    assert json_size(value, 1 << 20) == exact
    assert _expanded_size(value, 1 << 20, _value_children, _value_size) == exact  # the walk agrees


def test_an_alias_bomb_is_measured_as_expanded_in_the_time_of_its_text() -> None:
    """Ten levels of ten aliases: 10^10 leaves as written in 300 bytes. The composed document is
    measured past the cap by visiting each distinct node once (no expansion is ever built)."""
    from service.api.doc_size import SelfReference, yaml_node_size

    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    node = yaml.compose("\n".join(lines), Loader=yaml.CSafeLoader)
    assert yaml_node_size(node, 1 << 20) > 1 << 20
    with pytest.raises(SelfReference):
        yaml_node_size(yaml.compose("a: &a [*a]", Loader=yaml.CSafeLoader), 1 << 20)


def test_a_page_of_jobs_stops_at_its_spec_budget(small_cap, auth, spec) -> None:
    """Each job stores up to twice the cap; a page of 100 such jobs would be 200 caps to serialise. A page
    stops once its specs pass 8 caps, and the cursor walks on to the rest."""
    from service.api.routes.jobs import PAGE_SPEC_CAPS

    near_cap = {**spec, "evaluation": {"prompts": ["p" * 700] * 3}}
    made = []
    for _ in range(6):
        r = small_cap.post("/v1/jobs", json={"spec": near_cap}, headers=auth)
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
    seen, after, pages = [], None, 0
    while True:
        r = small_cap.get(
            "/v1/jobs", params={"limit": 100, **({"after": after} if after else {})}, headers=auth
        )
        page = r.json()
        assert len(r.content) <= (PAGE_SPEC_CAPS + 2) * 4096, len(r.content)
        seen += [j["id"] for j in page["data"]]
        pages += 1
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    assert seen == made[::-1] and pages > 1
