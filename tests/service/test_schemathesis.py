"""Property-based run of every route (authenticated): no 5xx, and every response matches the schema."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

CHECKS = [not_a_server_error, response_schema_conformance]


def test_no_server_errors_and_schema_conformance(app, auth, redis_conn) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 22  # every method+path, health and metrics included

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def run(case) -> None:
            case.call_and_validate(headers=auth, checks=CHECKS)

        run()
