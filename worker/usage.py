"""The worker's side of the storage ledger: after it publishes (or reuses) an artifact, record its bytes
against the job's project (`service.crud.usage.record_usage`), retried through a database outage."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.crud.usage import record_usage
from service.db.retry import retry_transient


def local_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a file or a directory); 0 when it does not exist."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while we walk (a pruned checkpoint)
                continue
    return total


def record(
    sessions: sessionmaker[Session],
    project_id: str,
    job_id: str,
    kind: str,
    key: str,
    nbytes: int,
    *,
    tolerance_s: float = 0.0,
) -> None:
    """Charge `nbytes` under `key` to the project, for `job_id` (replacing what this job recorded there)."""

    def write() -> None:
        with sessions() as session:
            record_usage(session, project_id, kind, key, nbytes, job_id=job_id)
            session.commit()

    retry_transient(write, tolerance_s=tolerance_s, what=f"recording the storage of job {job_id}")
