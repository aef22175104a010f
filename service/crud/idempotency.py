"""Idempotency keys: per project, remembering which job a request created and a hash of its body."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.db.models import IdempotencyKey, utcnow


def request_hash(body: Any) -> str:
    """sha256 of the canonical JSON of a request body (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# A key protects retries, not history: after a day the same key may create a new job.
TTL = timedelta(hours=24)


def find(session: Session, project_id: str, key: str) -> IdempotencyKey | None:
    """The live (younger than TTL) record of `key` in the project, or None."""
    return session.scalar(
        select(IdempotencyKey).where(
            IdempotencyKey.project_id == project_id,
            IdempotencyKey.key == key,
            IdempotencyKey.created_at >= utcnow() - TTL,
        )
    )


def remember(session: Session, project_id: str, key: str, body_hash: str, job_id: str) -> IdempotencyKey:
    """Add the key to the session (replacing an expired record of it); a concurrent twin makes the
    commit raise IntegrityError."""
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.project_id == project_id,
            IdempotencyKey.key == key,
            IdempotencyKey.created_at < utcnow() - TTL,
        )
    )
    row = IdempotencyKey(
        project_id=project_id, key=key, request_hash=body_hash, job_id=job_id, created_at=utcnow()
    )
    session.add(row)
    return row


def purge_expired_keys(session: Session) -> int:
    """Delete every record older than TTL (the caller commits); returns how many."""
    result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < utcnow() - TTL))
    return result.rowcount or 0
