"""Stateful Schemathesis run: calls chained along the OpenAPI links (create a job or dataset, then use its
id), so the id-taking routes see real resources and not only random ids; no 5xx, schema-conformant."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    ensure_resource_availability,
    response_schema_conformance,
    use_after_free,
)

from tests.fixtures.stack import new_key

CHECKS = [not_a_server_error, response_schema_conformance, ensure_resource_availability, use_after_free]
_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_linked_calls_reach_real_resources(app, db_url, spec, redis_conn) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls: Counter[tuple[str, str, int]] = Counter()

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # A fresh project per scenario: every scenario starts from empty lists, so Hypothesis can
            # replay one exactly (its rule choices depend on which responses had ids in them).
            self.auth = {"Authorization": f"Bearer {new_key(db_url)}"}

        def before_call(self, case: Any) -> None:
            # Random bodies almost never name a server path under the allowed roots or valid JSONL, so
            # the creating calls get a valid body; everything after them is generated and linked.
            if case.method == "POST" and case.path == "/v1/jobs":
                case.body = {"spec": spec}
            elif case.method == "POST" and case.path == "/v1/datasets":
                case.body = {"file": (json.dumps(_ROW) + "\n").encode()}
            case.headers = {**(case.headers or {}), **self.auth}
            if case.path.endswith("/events"):  # a queued job's live stream never ends: ask for a page
                case.headers["Accept"] = "application/json"

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            calls[(case.method, case.path, response.status_code)] += 1
            checks = CHECKS
            if case.path.endswith("/tensorboard"):
                # A job's TensorBoard archive exists only once it logged to TensorBoard: its 404 for a job
                # just created is the documented answer, not a lost resource.
                checks = [c for c in CHECKS if c is not ensure_resource_availability]
            case.validate_response(response, checks=checks, recorder=self.recorder)

    Workflow.run(
        settings=settings(
            max_examples=12,
            stateful_step_count=4,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
    )
    # Links were followed: an id-taking route answered 200 for an id a create call returned.
    linked = {(m, p) for (m, p, status) in calls if status == 200 and "{" in p}
    assert any(p.startswith(("/v1/jobs/{job_id}", "/v1/datasets/{dataset_id}")) for _, p in linked), calls
