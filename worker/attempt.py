"""The one context every per-attempt poller of a job is built from (the monitor, the progress writer, the
checkpoint mirror, the trackers, the gang's leader and members)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker


@dataclass(frozen=True)
class AttemptContext:
    """One attempt of one job: the database its rows are in, the job, and the attempt number that fences
    every write made for it (a newer attempt's claim makes them no-ops)."""

    sessions: sessionmaker[Session]
    job_id: str
    attempt: int
