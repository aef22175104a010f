"""Idempotency keys: per project, remembering which job a request created and a hash of its body."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import IdempotencyKey, utcnow


def request_hash(body: Any) -> str:
    """sha256 of the canonical JSON of a request body (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find(session: Session, project_id: str, key: str) -> IdempotencyKey | None:
    return session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.project_id == project_id, IdempotencyKey.key == key)
    )


def remember(session: Session, project_id: str, key: str, body_hash: str, job_id: str) -> IdempotencyKey:
    """Add the key to the session; a concurrent twin makes the commit raise IntegrityError."""
    row = IdempotencyKey(
        project_id=project_id, key=key, request_hash=body_hash, job_id=job_id, created_at=utcnow()
    )
    session.add(row)
    return row
