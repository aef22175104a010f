"""Projects and their API keys: keys are shown once, stored as sha256, recognisable by `peagle_sk_`."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import ApiKey, Project, utcnow
from service.db.vanished import reread

KEY_PREFIX = "peagle_sk_"


def hash_key(key: str) -> str:
    """sha256 hex of a key: keys carry 256 random bits, so a fast unsalted hash is safe to store."""
    return hashlib.sha256(key.encode()).hexdigest()


def get_project(session: Session, project_id: str) -> Project | None:
    return session.get(Project, project_id)


def project_by_name(session: Session, name: str) -> Project | None:
    return session.scalar(select(Project).where(Project.name == name))


def list_projects(session: Session) -> list[Project]:
    """Every project, by name."""
    return list(session.scalars(select(Project).order_by(Project.name)))


def get_or_create_project(session: Session, name: str) -> Project:
    """The project called `name`, created if missing (safe when two processes race)."""
    project = project_by_name(session, name)
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
    row = live_key(session, key)
    return session.get(Project, row.project_id) if row is not None else None


def key_is_live(session: Session, key_hash: str) -> bool:
    """Whether the key with this hash exists and is not revoked (an open event stream re-checks it)."""
    row = session.scalar(select(ApiKey.revoked_at.is_(None)).where(ApiKey.key_hash == key_hash))
    return bool(row)


def list_keys(session: Session, project_name: str | None = None) -> list[tuple[ApiKey, str]]:
    """Every key (live and revoked) with its project's name, oldest first; optionally of one project."""
    query = select(ApiKey, Project.name).join(Project, ApiKey.project_id == Project.id)
    if project_name is not None:
        query = query.where(Project.name == project_name)
    return [(key, name) for key, name in session.execute(query.order_by(ApiKey.created_at, ApiKey.id))]


def revoke_key(session: Session, key_id: str) -> ApiKey | None:
    """Mark the key revoked (the caller commits): the next request with it gets 401, since every request
    looks the key up. None when there is no such key; an already revoked key keeps its first date."""
    row = session.get(ApiKey, key_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def rotate_key(session: Session, key_id: str) -> tuple[str, ApiKey] | None:
    """A new key for the same project and the old one revoked, in one commit; None for an unknown or
    already revoked key. Returns (plaintext, new row)."""
    old = session.get(ApiKey, key_id)
    if old is None or not _revoke_if_live(session, key_id):
        return None
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        project_id=old.project_id, key_hash=hash_key(plaintext), prefix=plaintext[: len(KEY_PREFIX) + 6]
    )
    session.add(row)
    session.commit()
    return plaintext, row


def _revoke_if_live(session: Session, key_id: str) -> bool:
    """Revoke the key if no one has yet, as one conditional UPDATE: of two concurrent rotations of one
    key only one revokes it, so only one successor is made."""
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session="fetch")
    )
    return result.rowcount == 1


def live_key(session: Session, key: str) -> ApiKey | None:
    """The unrevoked key row for a plaintext key (the API's bearer check, the dashboard's sign-in), or None.

    Keys are compared as sha256 digests, never as plaintext: the index lookup's timing depends on the
    digest of the guess, which tells nothing about the key; the found row is confirmed with a
    constant-time comparison."""
    digest = hash_key(key)
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None)))
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return row


def live_key_by_id(session: Session, key_id: str) -> ApiKey | None:
    """An unrevoked key by its id (a dashboard session names its key, and ends when the key is revoked)."""
    return session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)))


def session_nonce(session: Session, key: ApiKey) -> str:
    """The key's dashboard session nonce, made on first use (the caller commits). Made by a conditional
    UPDATE: of two first sign-ins at once, both cookies carry the one nonce that was stored."""
    if key.session_nonce is None:
        session.execute(
            update(ApiKey)
            .where(ApiKey.id == key.id, ApiKey.session_nonce.is_(None))
            .values(session_nonce=secrets.token_urlsafe(24))
            .execution_options(synchronize_session=False)
        )
        key = reread(session, key, "key")
    return key.session_nonce or ""


def end_sessions(session: Session, key_id: str) -> None:
    """Sign the key out of the dashboard everywhere: a new nonce invalidates every cookie issued for it,
    copies included (the caller commits)."""
    key = session.get(ApiKey, key_id)
    if key is not None:
        key.session_nonce = secrets.token_urlsafe(24)
