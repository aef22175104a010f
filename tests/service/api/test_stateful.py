"""Stateful Schemathesis run: calls chained along the OpenAPI links (create a job or dataset, then use its
id), so the id-taking routes see real resources and not only random ids; no 5xx, schema-conformant. A job
created is inspected, cancelled and deleted along the links. It prints one JSON line of its counts."""

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
    created: set[str] = set()  # ids that a create call returned
    on_created: Counter[tuple[str, str, int]] = Counter()  # calls whose path id is one of them
    linked: Counter[str] = Counter()  # link id -> calls whose parameters it filled in
    failures: Counter[str] = Counter()

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

        def step(self, input: Any) -> Any:
            if input.transition is not None and input.is_applied:
                linked[input.transition.id] += 1
            return super().step(input)

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            key = (case.method, case.path, response.status_code)
            calls[key] += 1
            if set((case.path_parameters or {}).values()) & created:
                on_created[key] += 1
            if case.method == "POST" and response.status_code == 201:
                created.add(response.json()["id"])
            checks = CHECKS
            if case.path.endswith("/tensorboard"):
                # A job's TensorBoard archive exists only once it logged to TensorBoard: its 404 for a job
                # just created is the documented answer, not a lost resource.
                checks = [c for c in CHECKS if c is not ensure_resource_availability]
            try:
                case.validate_response(response, checks=checks, recorder=self.recorder)
            except Exception:
                failures[f"{case.method} {case.path}"] += 1
                raise

    try:
        Workflow.run(
            settings=settings(
                # Enough runs and steps that a created dataset is also read before some run deletes it:
                # at 60 x 8 a full suite's run once drew no such sequence (the draws follow the schema).
                max_examples=100,
                stateful_step_count=10,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
        )
    finally:  # printed on failure too, so a failing run still reports what it reached
        line = {
            "schemathesis": "stateful",
            "database": db_url.split(":", 1)[0].split("+", 1)[0],
            "operations": len({(m, p) for m, p, _ in calls}),
            "examples": sum(calls.values()),
            "linked_calls": sum(linked.values()),
            "links_followed": len(linked),
            "failures": sum(failures.values()),
            "on_created_ids": {f"{m} {p} {s}": n for (m, p, s), n in sorted(on_created.items())},
        }
        print(json.dumps(line))
    # The links reach every step of a resource's life for an id a create call returned: a job is
    # inspected, cancelled and deleted, a dataset inspected and deleted. Which answer a job's delete gets
    # depends on the rule order Hypothesis drew (200 once cancelled, 409 while still queued); both are the
    # documented answers, and both show the link was followed.
    for method, path, answers in [
        ("GET", "/v1/jobs/{job_id}", {200}),
        ("POST", "/v1/jobs/{job_id}/cancel", {200}),
        ("DELETE", "/v1/jobs/{job_id}", {200, 409}),
        ("GET", "/v1/datasets/{dataset_id}", {200}),
        ("DELETE", "/v1/datasets/{dataset_id}", {200}),
    ]:
        reached = sum(on_created[(method, path, status)] for status in answers)
        assert reached >= 1, (method, path, dict(on_created))
