"""Request bodies are capped (PEAGLE_MAX_SPEC_BYTES -> 413) and spec bounds answer 422 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest


@pytest.fixture
def small_cap_client(make_settings, redis_conn) -> Iterator[object]:
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(make_settings(max_spec_bytes=4096)), raise_server_exceptions=False) as c:
        yield c


def test_oversized_spec_body_is_413(small_cap_client, auth, spec) -> None:
    big = {**spec, "evaluation": {"prompts": ["x" * 1000] * 10}}
    r = small_cap_client.post("/v1/jobs", json={"spec": big}, headers=auth)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "payload_too_large"
    assert "PEAGLE_MAX_SPEC_BYTES" in r.json()["error"]["message"]

    # Without a Content-Length (chunked), the body is counted as it arrives.
    body = json.dumps({"spec": big}).encode()
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))
    r = small_cap_client.post(
        "/v1/jobs", content=chunks, headers={**auth, "Content-Type": "application/json"}
    )
    assert r.status_code == 413, r.text

    # Under the cap the same route works.
    assert small_cap_client.post("/v1/jobs", json={"spec": spec}, headers=auth).status_code == 201


def test_out_of_bounds_spec_fields_are_422_naming_the_field(client, auth, spec) -> None:
    for patch, param in [
        ({"training": {"seed": 2**63}}, "spec.training.seed"),
        ({"evaluation": {"speculative_tokens": [1, 9]}}, None),
        ({"dataset": {**spec["dataset"], "max_samples": 10**12}}, "spec.dataset.max_samples"),
    ]:
        r = client.post("/v1/jobs", json={"spec": {**spec, **patch}}, headers=auth)
        assert r.status_code == 422, r.text
        if param:
            assert r.json()["error"]["param"] == param
        else:
            assert "speculative_tokens" in r.json()["error"]["message"]
    ok = client.post(
        "/v1/jobs", json={"spec": {**spec, "evaluation": {"speculative_tokens": [2, 1, 2]}}}, headers=auth
    )
    assert ok.status_code == 201, ok.text
    assert ok.json()["spec"]["evaluation"]["speculative_tokens"] == [1, 2]
