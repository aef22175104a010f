"""API-suite fixtures: the whole module runs against SQLite and, when configured, Postgres too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.stack import db_backends


@pytest.fixture(scope="session", params=db_backends())
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_db_url")


@pytest.fixture
def spec(settings: Any) -> dict[str, Any]:
    """A valid job spec naming a verifier dir and a JSONL file under the allowed roots."""
    model_dir = Path(settings.allowed_model_roots[0]) / "verifier"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    data = Path(settings.allowed_data_roots[0]) / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    return {
        "verifier": {"name_or_path": str(model_dir)},
        "dataset": {"path": str(data), "seq_len": 64},
        "training": {"max_steps": 2, "total_seq_len": 128},
    }


def create_job(client: Any, auth: dict[str, str], spec: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = client.post("/v1/jobs", json={"spec": spec}, headers={**auth, **headers})
    assert r.status_code == 201, r.text
    return r.json()
