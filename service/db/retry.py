"""Riding out a database outage: retry an operation on transient errors, with backoff, for a bounded time.

A worker must not lose hours of training to a database restart or failover: its writes are retried for
up to `Settings.db_outage_tolerance_s` (`PEAGLE_DB_OUTAGE_TOLERANCE_S`). Only connection-level errors are
transient; a constraint violation or a bug fails at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """A lost or refused connection, a server shutting down, an exhausted pool: worth retrying."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def retry_transient(
    fn: Callable[[], T],
    *,
    tolerance_s: float,
    what: str,
    first_delay_s: float = 0.5,
    max_delay_s: float = 10.0,
) -> T:
    """`fn()`, retried with exponential backoff while it raises transient database errors, for up to
    `tolerance_s` seconds in all; then the last error is raised. `fn` must be safe to run again (one
    transaction that either committed or did not)."""
    deadline = time.monotonic() + tolerance_s
    delay = first_delay_s
    while True:
        try:
            return fn()
        except Exception as exc:
            left = deadline - time.monotonic()
            if not is_transient(exc) or left <= 0:
                raise
            log.warning(
                "database unavailable while %s (%s); retrying in %.1fs", what, type(exc).__name__, delay
            )
            time.sleep(min(delay, left))
            delay = min(delay * 2, max_delay_s)
