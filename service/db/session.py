"""Engines and sessions: one cached engine per database URL; SQLite in WAL mode so API and worker share it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL lets the worker write while the API reads; busy_timeout waits out the other writer.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A new engine for `url`; SQLite files get their directory created and WAL pragmas on connect."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        if parsed.database and parsed.database != ":memory:":
            # As for Postgres below: a connection for each of the API's 40 threadpool workers, so a thread
            # waiting for the write lock never leaves the others queueing for a connection.
            kwargs.setdefault("pool_size", 10)
            kwargs.setdefault("max_overflow", 40)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # No pool_pre_ping: it costs a round trip per request; a dead pooled connection instead fails one
    # request with a 503 and is discarded (pool_recycle bounds its age). The overflow covers the API's
    # 40 threadpool workers so threads never queue for a connection.
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 40)
    kwargs.setdefault("pool_recycle", 1800)
    kwargs.setdefault("pool_timeout", 10)
    # A short connect timeout turns "database down" into a prompt 503 instead of a hung request.
    if parsed.get_backend_name() == "postgresql":
        kwargs.setdefault("connect_args", {"connect_timeout": 5})
    return create_engine(url, **kwargs)


def get_engine(url: str) -> Engine:
    """The process-wide engine for `url` (created on first use)."""
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = make_engine(url)
        return engine


def dispose_engines() -> None:
    """Close every cached engine's pool (tests, and forked worker children before reconnecting)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def session_factory(url: str) -> sessionmaker[Session]:
    """A sessionmaker bound to the engine for `url`; objects stay readable after commit."""
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
