"""Client input that is not in the OpenAPI schema, fuzzed: upload lines, filenames and framing, and the
SSE resume header. Whatever arrives, the answer is never a 5xx, and a refusal names the field or line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.conftest import create_job

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
GOOD_LINE = json.dumps(
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
)

# JSON that is valid but odd, and bytes that are not JSON (or not UTF-8) at all.
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_lines = st.one_of(
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"", b"\xff\xfe", b"1e999999", b'{"messages": [{"role": "user"}]}', b"[" * 2000]),
)


def _header(text: str) -> bytes:
    """`text` as raw header bytes (what a client can put on the wire: latin-1, no line breaks)."""
    return text.encode("latin-1", "replace").replace(b"\r", b"").replace(b"\n", b"")


def _refusal_names_something(r: Any) -> None:
    assert r.status_code < 500, r.text
    if r.status_code == 422:
        error = r.json()["error"]
        assert error["param"] or "line" in error["message"], error


@pytest.fixture
def events_job(client, auth, spec) -> str:
    """A finished job (its event stream ends by itself)."""
    job = create_job(client, auth, spec)
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth).status_code == 200
    return job["id"]


def test_upload_lines_and_filenames_never_answer_5xx(client, auth) -> None:
    @FUZZ
    @given(lines=st.lists(_lines, min_size=1, max_size=4), filename=st.text(max_size=300))
    def upload(lines: list[bytes], filename: str) -> None:
        body = GOOD_LINE.encode() + b"\n" + b"\n".join(lines) + b"\n"
        r = client.post("/v1/datasets", files={"file": (filename, body)}, headers=auth)
        _refusal_names_something(r)
        if r.status_code == 422:
            assert r.json()["error"]["param"] == "file"

    upload()


def test_upload_framing_never_answers_5xx(client, auth) -> None:
    @FUZZ
    @given(
        content_type=st.one_of(
            st.just("multipart/form-data"),
            st.text(max_size=100).map(lambda t: f"multipart/form-data; boundary={t}"),
            st.text(max_size=60),
        ),
        content_length=st.one_of(st.none(), st.text(max_size=30), st.integers(-(10**30), 10**30).map(str)),
        body=st.binary(max_size=300),
    )
    def post(content_type: str, content_length: str | None, body: bytes) -> None:
        headers = {**auth, "Content-Type": _header(content_type)}
        if content_length is not None:
            headers["Content-Length"] = _header(content_length)
        _refusal_names_something(client.post("/v1/datasets", content=body, headers=headers))

    post()


def test_last_event_id_and_cursors_never_answer_5xx(client, auth, events_job) -> None:
    @FUZZ
    @given(
        last_event_id=st.one_of(
            st.text(max_size=40),
            st.sampled_from(["²", "٣", "9" * 5000, str(2**63), "-1", " 7 ", "0x10"]),
            st.integers(-(2**70), 2**70).map(str),
        ),
        after=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    )
    def follow(last_event_id: str, after: int | None) -> None:
        headers = {**auth, "Accept": "text/event-stream", "Last-Event-ID": _header(last_event_id)}
        url = f"/v1/jobs/{events_job}/events" + (f"?after={after}" if after is not None else "")
        r = client.get(url, headers=headers)
        _refusal_names_something(r)
        if r.status_code == 422:
            assert r.json()["error"]["param"] in ("Last-Event-ID", "after")
        r = client.get(url.replace("/events", "/metrics"), headers=auth)
        assert r.status_code < 500, r.text

    follow()


def test_the_5xx_the_fuzz_found_are_422_naming_the_field(client, auth, events_job) -> None:
    sse = {**auth, "Accept": "text/event-stream"}
    for bad in ("²", "9" * 5000, str(1 << 63), "-1", "x"):  # "²".isdigit() is True; int() refuses it
        r = client.get(f"/v1/jobs/{events_job}/events", headers={**sse, "Last-Event-ID": _header(bad)})
        assert r.status_code == 422 and r.json()["error"]["param"] == "Last-Event-ID", (bad, r.text)
    r = client.get(f"/v1/jobs/{events_job}/events", headers={**sse, "Last-Event-ID": " 1 "})
    assert r.status_code == 200 and "data: " in r.text, r.text
    for path in ("events", "metrics"):
        r = client.get(f"/v1/jobs/{events_job}/{path}?after={1 << 63}", headers=auth)
        assert r.status_code == 422 and r.json()["error"]["param"] == "after", r.text


def test_error_fields_are_redacted_before_they_are_returned_or_stored(client, auth, spec, settings) -> None:
    from service.crud import jobstate
    from service.db.session import session_factory

    # A client's own key naming a server path comes back in error.param: redacted like a message.
    r = client.post("/v1/jobs", json={"spec": {**spec, "/srv/secret/dir": 1}}, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "/srv/secret" not in json.dumps(error) and error["param"] == "spec.<server>/dir"
    # A worker's error (message and param) is redacted when it is stored, and again when it is returned.
    job = create_job(client, auth, spec)
    with session_factory(settings.database_url)() as s:
        assert jobstate.claim(s, job["id"], "w")
        s.commit()
        moved = jobstate.transition(
            s,
            job["id"],
            "failed",
            expect=("running",),
            error={"code": "x", "message": "cannot read /data/scratch/jobs/j/file.bin", "param": "/etc/p"},
        )
        assert moved
        from service.db.models import Job

        stored = s.get(Job, job["id"]).error
    assert stored == {"code": "x", "message": "cannot read <server>/file.bin", "param": "<server>/p"}
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).json()["error"] == stored
