"""The project lock every limit check (and every write it admits) holds, on Postgres and on SQLite."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Project


def lock_project(session: Session, project_id: str) -> Project | None:
    """The project row, locked until the transaction ends, so that checks of its limits and the writes
    they admit happen one request at a time.

    Postgres: `SELECT ... FOR UPDATE` on the row. SQLite ignores FOR UPDATE, and its default deferred
    transaction lets two readers both pass a check before either writes; `BEGIN IMMEDIATE` takes the
    database's write lock first (waiting out the busy timeout), so the reads after it see every earlier
    commit and no other writer until ours ends.
    """
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        dbapi = conn.connection.dbapi_connection
        # pysqlite opens a transaction only before its first write; one already open holds the lock.
        if dbapi is not None and not dbapi.in_transaction:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
    query = select(Project).where(Project.id == project_id).with_for_update()
    # populate_existing: the request loaded the row before the lock; read its limits again under it.
    return session.scalar(query.execution_options(populate_existing=True))
