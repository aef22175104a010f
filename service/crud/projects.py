"""Projects and their API keys: keys are shown once, stored as sha256, recognisable by `peagle_sk_`."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import ApiKey, Project

KEY_PREFIX = "peagle_sk_"


def hash_key(key: str) -> str:
    """sha256 hex of a key: keys carry 256 random bits, so a fast unsalted hash is safe to store."""
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_project(session: Session, name: str) -> Project:
    """The project called `name`, created if missing (safe when two processes race)."""
    project = session.scalar(select(Project).where(Project.name == name))
    if project is not None:
        return project
    try:
        with session.begin_nested():
            project = Project(name=name)
            session.add(project)
    except IntegrityError:
        project = session.scalars(select(Project).where(Project.name == name)).one()
    return project


def create_key(session: Session, project_name: str) -> tuple[str, ApiKey]:
    """Create an API key for `project_name` (creating the project) and commit; returns (plaintext, row)."""
    project = get_or_create_project(session, project_name)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(project_id=project.id, key_hash=hash_key(plaintext), prefix=plaintext[: len(KEY_PREFIX) + 6])
    session.add(row)
    session.commit()
    return plaintext, row


def project_for_key(session: Session, key: str) -> Project | None:
    """The project owning a live key, or None for an unknown or revoked key."""
    return session.scalar(
        select(Project)
        .join(ApiKey, ApiKey.project_id == Project.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )


def live_key(session: Session, key: str) -> ApiKey | None:
    """The unrevoked key row for a plaintext key (the dashboard's sign-in), or None."""
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))


def live_key_by_id(session: Session, key_id: str) -> ApiKey | None:
    """An unrevoked key by its id (a dashboard session names its key, and ends when the key is revoked)."""
    return session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)))
