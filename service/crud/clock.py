"""Database time: every liveness stamp and comparison uses the database's clock, not a machine's own.

Heartbeats written by one machine and judged by another (the reconciler) must share one clock, or clock
skew between them reads as a dead worker. SQLite is embedded (one machine, one clock), so there Python's
UTC time is the database's time.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import utcnow


def _server_clock(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def db_now_sql(session: Session) -> Any:
    """The database's current time as a value for an INSERT/UPDATE (`now()` on Postgres)."""
    return func.now() if _server_clock(session) else utcnow()


def db_now(session: Session) -> datetime:
    """The database's current time, read now (timezone-aware UTC)."""
    if not _server_clock(session):
        return utcnow()
    value = session.execute(select(func.now())).scalar_one()
    return value.astimezone(UTC)
