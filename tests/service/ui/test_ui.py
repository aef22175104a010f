"""The dashboard over HTTP (no browser): sign-in cookie and CSRF, project isolation of every page and
download, the editor's inline errors, and assets served locally. The browser flow is tests/e2e/test_ui.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from service.crud.checkpoints import add_checkpoint
from service.crud.metrics import add_metrics
from service.db.session import session_factory
from tests.service.conftest import create_job

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
HTML = {"Accept": "text/html"}


def csrf_of(client: Any, path: str = "/ui/login") -> str:
    return CSRF.search(client.get(path).text).group(1)


def sign_in(client: Any, key: str) -> None:
    r = client.post("/ui/login", data={"api_key": key, "csrf_token": csrf_of(client)}, follow_redirects=False)
    assert r.status_code == 303, r.text


@pytest.fixture
def other_client(app: Any, redis_conn: Any) -> Any:
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


def test_root_redirects_and_pages_need_a_session(client) -> None:
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui/"
    r = client.get("/ui/jobs/new?x=1&y=2", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login?next=/ui/jobs/new%3Fx%3D1%26y%3D2"
    r = client.get("/ui/data/jobs/job_x/metrics")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_sign_in_sets_a_strict_httponly_cookie_and_checks_csrf(client, api_key) -> None:
    login = client.get("/ui/login")
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    token = CSRF.search(login.text).group(1)

    r = client.post("/ui/login", data={"api_key": api_key, "csrf_token": "forged"}, follow_redirects=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = client.post("/ui/login", data={"api_key": "peagle_sk_wrong", "csrf_token": token})
    assert r.status_code == 200 and "unknown or revoked" in r.text and 'aria-invalid="true"' in r.text
    r = client.post(
        "/ui/login",
        data={"api_key": api_key, "csrf_token": token, "next": "https://evil.example/"},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == "/ui/"  # never an open redirect
    session_cookie = r.headers["set-cookie"]
    assert "HttpOnly" in session_cookie and "SameSite=strict" in session_cookie
    assert api_key not in session_cookie  # the cookie names the key's id, never the key
    assert client.get("/ui/").status_code == 200

    # The token rotates at sign-in; a form posted with the pre-sign-in token is refused.
    r = client.post("/ui/logout", data={"csrf_token": token}, follow_redirects=False)
    assert r.status_code == 403
    r = client.post("/ui/logout", data={"csrf_token": csrf_of(client, "/ui/")}, follow_redirects=False)
    assert r.status_code == 303
    assert client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 303


def test_sign_out_ends_a_copied_cookie(client, other_client, api_key) -> None:
    """The key's session nonce is rotated server-side at sign-out: a cookie copied before it (another
    browser, a stolen copy) is no session afterwards, though its signature is still valid."""
    sign_in(client, api_key)
    copied = client.cookies.get("peagle_session")
    other_client.cookies.set("peagle_session", copied)
    assert other_client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 200
    r = client.post("/ui/logout", data={"csrf_token": csrf_of(client, "/ui/")}, follow_redirects=False)
    assert r.status_code == 303
    assert other_client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 303
    assert other_client.get("/ui/data/jobs/job_x/metrics").status_code == 401
    sign_in(client, api_key)  # signing in again works, with the new nonce
    assert client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 200


@pytest.mark.parametrize(
    ("setting", "base_url", "secure"),
    [
        ("auto", "http://localhost", False),
        ("auto", "http://127.0.0.1:8000", False),
        ("auto", "http://[::1]:8000", False),
        ("auto", "http://peagle.example.com", True),  # e.g. behind a TLS proxy that forwards plain HTTP
        ("auto", "https://localhost", True),
        ("false", "http://peagle.example.com", False),
        ("true", "http://localhost", True),
    ],
)
def test_the_cookie_is_secure_outside_localhost(make_settings, redis_conn, setting, base_url, secure) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    app = create_app(make_settings(ui_secure_cookie=setting))
    with TestClient(app, base_url=base_url) as c:
        cookie = c.get("/ui/login").headers["set-cookie"]
    assert ("; secure" in cookie.lower()) is secure, cookie


def test_a_tampered_cookie_is_not_a_session(client, api_key) -> None:
    sign_in(client, api_key)
    value = client.cookies.get("peagle_session")
    payload, signature = value.rsplit(".", 1)
    client.cookies.clear()
    client.cookies.set("peagle_session", f"{payload}.{signature[::-1]}")
    assert client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 303
    client.cookies.clear()
    client.cookies.set("peagle_session", value)
    assert client.get("/ui/", headers=HTML, follow_redirects=False).status_code == 200


def test_another_projects_pages_and_downloads_answer_404(
    client, other_client, auth, api_key, other_api_key, spec, settings
) -> None:
    job = create_job(client, auth, spec)
    sessions = session_factory(settings.database_url)
    from service.db.models import Job

    with sessions() as s:
        project_id = s.get(Job, job["id"]).project_id
        add_metrics(s, job["id"], 1, {"step": 1, "loss": 2.0})
        ckpt = add_checkpoint(
            s,
            job_id=job["id"],
            project_id=project_id,
            step=1,
            uri="checkpoints/x",
            files=[{"name": "config.json", "size": 2, "sha256": "0" * 64}],
            metrics={
                "eval": {
                    "step": 1,
                    "results": {
                        "k=2": {"k": 2, "acceptance_length": 2.125, "vllm": {"acceptance_length": 2.0625}}
                    },
                }
            },
        )
        s.commit()
        ckpt_id = ckpt.id
    sign_in(client, api_key)
    sign_in(other_client, other_api_key)
    paths = [
        f"/ui/jobs/{job['id']}",
        f"/ui/jobs/{job['id']}/panel?part=details",
        f"/ui/compare?job={job['id']}",
        f"/ui/data/jobs/{job['id']}/metrics",
        f"/ui/data/jobs/{job['id']}/events",
        f"/ui/jobs/{job['id']}/tensorboard",
        f"/ui/checkpoints/{ckpt_id}/archive",
        f"/ui/checkpoints/{ckpt_id}/files/config.json",
    ]
    for path in paths:
        assert other_client.get(path).status_code == 404, path
    for path in paths[:5]:
        assert client.get(path).status_code == 200, path
    assert client.get(f"/ui/data/jobs/{job['id']}/metrics").json()["data"][0]["values"]["loss"] == 2.0
    # The checkpoint's acceptance length, ours and vLLM's side by side.
    details = client.get(f"/ui/jobs/{job['id']}/panel?part=details").text
    assert "2.125" in details and "2.062" in details and ckpt_id in details
    # Cancelling another project's job: 404, and the job is untouched.
    token = csrf_of(other_client, "/ui/")
    r = other_client.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf_token": token}, follow_redirects=False)
    assert r.status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).json()["status"] == "queued"
    assert job["id"] not in other_client.get("/ui/").text
    # The list's status filter: "all" sends an empty value.
    assert job["id"] in client.get("/ui/?status=").text
    assert job["id"] in client.get("/ui/fragments/jobs?status=queued").text
    assert job["id"] not in client.get("/ui/fragments/jobs?status=running").text


def test_editor_renders_thousands_of_errors_in_linear_time_showing_the_first_50(
    client, api_key, spec
) -> None:
    sign_in(client, api_key)
    token = csrf_of(client, "/ui/jobs/new")
    # One error per list item, each on a line of its own: the page used to match every error against
    # every line (6000 x 6000).
    many = {**spec, "verifier": {**spec["verifier"], "layer_ids": ["x"] * 6000}}
    text = yaml.safe_dump(many, sort_keys=False)
    r = client.post("/ui/jobs/new", data={"spec_yaml": text, "csrf_token": token, "action": "validate"})
    assert r.status_code == 200
    assert "6000 problems in the spec (the first 50 shown)" in r.text
    assert r.text.count('class="field-error"') == 50
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.strip() == "- x")
    assert f'data-param="verifier.layer_ids.0" data-line="{first}"' in r.text
    assert r.text.count('<span class="bad"') == 50  # the gutter marks the 50 lines shown

    unknown = {**spec, "resources": {"queue": "made-up"}}
    r = client.post("/ui/jobs/new", data={"spec_yaml": yaml.safe_dump(unknown), "csrf_token": token})
    assert 'data-param="resources.queue"' in r.text and "unknown queue" in r.text


def test_the_job_page_shows_acceptance_per_position_and_category_and_the_speedup(
    client, auth, api_key, spec, settings
) -> None:
    from service.db.models import Job
    from tests.fixtures.eval_reports import UI_EVAL as eval_json

    job = create_job(client, auth, spec)
    sessions = session_factory(settings.database_url)
    with sessions() as s:
        project_id = s.get(Job, job["id"]).project_id
        for step in (1, 5):  # an early checkpoint recorded before any evaluation shows no tables
            add_checkpoint(
                s, job_id=job["id"], project_id=project_id, step=step, uri=f"checkpoints/x{step}",
                files=[{"name": "config.json", "size": 2, "sha256": "0" * 64}],
                metrics={"eval": eval_json, "eval/vllm_speedup@2": 1.2272} if step == 5 else {},
            )  # fmt: skip
        s.commit()
    sign_in(client, api_key)
    details = client.get(f"/ui/jobs/{job['id']}/panel?part=details").text
    cards = details.split('<article class="checkpoint"')[1:]
    (measured,) = [c for c in cards if "step 5" in c]
    (bare,) = [c for c in cards if "step 1" in c]
    positions = measured.split('class="grid compact acceptance-positions"')[1].split("</table>")[0]
    rows = re.findall(
        r"<tr><td>(\d+)</td><td class=\"num\">(\d+)</td>\s*<td[^>]*>([^<]+)</td>\s*<td[^>]*>([^<]+)</td>",
        positions,
    )
    assert rows == [("2", "1", "0.688", "0.662"), ("2", "2", "0.188", "0.150")]
    categories = measured.split('class="grid compact acceptance-categories"')[1].split("</table>")[0]
    assert re.search(
        r"writing</td>\s*<td[^>]*>3</td>\s*<td[^>]*>2.250</td>\s*<td[^>]*>2.125</td>", categories
    )
    # A category is the client's text: escaped, never markup.
    assert "&lt;b&gt;math&lt;/b&gt;" in categories and "<b>math</b>" not in details
    assert re.search(r"<td[^>]*>1.500</td>\s*<td[^>]*>1.438</td>", categories)
    assert "1.23×" in measured and "20.2 tokens/s with the drafter at K=2" in measured
    assert "16.5 without, at batch 1 on 4 prompts" in measured
    assert "acceptance-positions" not in bare and "speed-up" not in bare
    # The API hands out the same figures.
    api = client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=auth).json()["data"]
    (row,) = [c for c in api if c["step"] == 5]
    assert row["metrics"]["eval"]["serving"]["speedup"]["speedup"] == 1.2272
    assert (
        row["metrics"]["eval"]["results"]["k=2"]["vllm"]["categories"]["writing"]["acceptance_length"]
        == 2.125
    )


def test_editor_shows_errors_at_their_line_and_submits_through_the_api(client, auth, api_key, spec) -> None:
    sign_in(client, api_key)
    token = csrf_of(client, "/ui/jobs/new")
    bad = {**spec, "training": {**spec["training"], "lr": -1}}
    text = yaml.safe_dump(bad, sort_keys=False)
    lr_line = next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith("lr:"))
    r = client.post("/ui/jobs/new", data={"spec_yaml": text, "csrf_token": token, "action": "submit"})
    assert r.status_code == 200  # the form again, errors inline (a 4xx page is a browser console error)
    assert f'data-param="training.lr" data-line="{lr_line}"' in r.text
    assert 'aria-invalid="true"' in r.text

    r = client.post("/ui/jobs/new", data={"spec_yaml": "verifier: [unclosed\n", "csrf_token": token})
    assert "invalid YAML" in r.text and 'id="resolved"' not in r.text

    outside = {**spec, "verifier": {"name_or_path": "/etc"}}
    r = client.post("/ui/jobs/new", data={"spec_yaml": yaml.safe_dump(outside), "csrf_token": token})
    assert 'data-param="verifier.name_or_path"' in r.text

    text = yaml.safe_dump(spec, sort_keys=False)
    r = client.post("/ui/jobs/new", data={"spec_yaml": text, "csrf_token": token, "action": "validate"})
    assert r.status_code == 200 and 'id="resolved"' in r.text
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []  # validating creates nothing

    form = {"spec_yaml": text, "csrf_token": token, "action": "submit", "idempotency_key": "form-1"}
    first = client.post("/ui/jobs/new", data=form, follow_redirects=False)
    again = client.post("/ui/jobs/new", data=form, follow_redirects=False)  # a double-clicked submit
    assert first.status_code == again.status_code == 303
    assert first.headers["location"] == again.headers["location"]
    (job,) = client.get("/v1/jobs", headers=auth).json()["data"]
    assert first.headers["location"] == f"/ui/jobs/{job['id']}"
    assert job["spec"]["training"]["lr"] == spec["training"].get("lr", 6e-4)


def test_cancel_and_upload_need_the_csrf_token(client, auth, api_key, spec) -> None:
    job = create_job(client, auth, spec)
    sign_in(client, api_key)
    r = client.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf_token": "nope"})
    assert r.status_code == 403
    token = csrf_of(client, f"/ui/jobs/{job['id']}")
    r = client.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf_token": token}, follow_redirects=False)
    assert r.status_code == 303
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).json()["status"] == "cancelled"

    body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    files = {"file": ("chat.jsonl", body, "application/jsonl")}
    assert client.post("/ui/data/datasets", files=files).status_code == 403
    r = client.post("/ui/data/datasets", files=files, headers={"X-CSRF-Token": token})
    assert r.status_code == 201 and r.json()["num_records"] == 1
    assert r.json()["id"] in client.get("/ui/datasets").text


def test_pages_load_nothing_from_other_origins(client, api_key) -> None:
    sign_in(client, api_key)
    for path in ("/ui/", "/ui/jobs/new", "/ui/compare", "/ui/datasets", "/ui/login"):
        r = client.get(path)
        assert r.status_code == 200
        assert "default-src 'self'" in r.headers["content-security-policy"]
        for src in re.findall(r'(?:src|href)="([^"]+)"', r.text):
            assert src.startswith(("/", "#")), (path, src)
    js = client.get("/ui/assets/plotly.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert (
        client.get("/ui/assets/plotly.min.js", headers={"If-None-Match": js.headers["etag"]}).status_code
        == 304
    )
