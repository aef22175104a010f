"""Health, readiness, Prometheus, the error envelope everywhere, DB outage -> 503, no torch import."""

from __future__ import annotations

import subprocess
import sys

from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import create_job


def _is_envelope(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"type", "code", "message", "param"}


def test_health_ready_metrics(client, auth, spec) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok", "database": "ok", "redis": "ok"}
    create_job(client, auth, spec)
    client.get("/v1/jobs/job_nope", headers=auth)
    text = client.get("/metrics").text
    assert 'peagle_http_requests_total{method="POST",route="/v1/jobs",status="201"} 1.0' in text
    assert 'route="/v1/jobs/{job_id}",status="404"' in text
    assert 'peagle_queue_depth{queue="default"} 1.0' in text
    assert 'peagle_jobs{status="queued"}' in text


def test_every_error_uses_the_envelope(client, auth) -> None:
    cases = [
        (client.get("/nope"), 404),
        (client.delete("/v1/jobs", headers=auth), 405),
        (client.get("/v1/jobs/job_nope", headers=auth), 404),
        (
            client.post(
                "/v1/jobs", content=b"{not json", headers={**auth, "Content-Type": "application/json"}
            ),
            422,
        ),
        (client.post("/v1/jobs", json={"spec": {}}, headers=auth), 422),
        (client.get("/v1/jobs", headers={}), 401),
    ]
    for response, status in cases:
        assert response.status_code == status
        assert _is_envelope(response.json()), response.text


def test_database_down_is_503_beside_an_app_whose_database_answers(make_settings, auth) -> None:
    # The two apps share their route objects (service.app._routes): each must answer from its own state.
    down = make_settings(database_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    with TestClient(create_app(down)) as c, TestClient(create_app(make_settings())) as up:
        for path in ("/v1/jobs", "/readyz"):
            r = c.get(path, headers=auth)
            assert r.status_code == 503 and _is_envelope(r.json())
            assert up.get(path, headers=auth).status_code == 200
        assert r.json()["error"]["code"] == "database_unavailable"
        assert c.get("/healthz").status_code == 200


def test_redis_down_readyz_is_503(make_settings) -> None:
    with TestClient(create_app(make_settings(redis_url="unix:///nonexistent/r.sock?db=0"))) as c:
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable"


def test_app_import_does_not_import_torch() -> None:
    code = (
        "import sys, service.app; service.app.create_app; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_keys_cli_creates_a_working_key(client, settings, monkeypatch) -> None:
    import typer
    from typer.testing import CliRunner

    import service.cli
    from service.settings import get_settings

    monkeypatch.setenv("PEAGLE_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        app = typer.Typer()
        service.cli.register(app)
        result = CliRunner().invoke(app, ["keys", "create", "--project", "cli-project"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    key = next(line for line in result.stdout.splitlines() if line.startswith("peagle_sk_"))
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
