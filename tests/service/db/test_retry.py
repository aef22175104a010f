"""Riding out a database outage: transient errors are retried within the tolerance, others fail at once."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from service.db.retry import is_transient, retry_transient


def _down() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


def test_transient_errors_are_retried_until_the_database_answers() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise _down()
        return "ok"

    assert retry_transient(flaky, tolerance_s=30, what="test", first_delay_s=0.01) == "ok"
    assert len(calls) == 3


def test_other_errors_and_an_exhausted_tolerance_are_raised() -> None:
    def conflict() -> None:
        raise IntegrityError("INSERT", {}, ValueError("duplicate key"))

    assert not is_transient(IntegrityError("INSERT", {}, ValueError("x")))
    with pytest.raises(IntegrityError):
        retry_transient(conflict, tolerance_s=30, what="test")

    calls = []

    def down() -> None:
        calls.append(1)
        raise _down()

    with pytest.raises(OperationalError):
        retry_transient(down, tolerance_s=0.2, what="test", first_delay_s=0.05)
    assert 2 <= len(calls) <= 6
