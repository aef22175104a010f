"""The database schema: SQLAlchemy 2 typed mapped classes (Postgres in production, SQLite embedded)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.db.jsondata import json_safe

# Deterministic constraint names so Alembic batch mode (SQLite) can alter tables.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# A job's states, defined once: the API's schema takes the Literal, the database's check constraint the tuple.
JobStatus = Literal["queued", "running", "cancelling", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


def _serial_id() -> Mapped[int]:
    # BIGINT in Postgres; SQLite autoincrements only an INTEGER PRIMARY KEY.
    return mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)


class SafeJSON(TypeDecorator[Any]):
    """JSONB on Postgres (indexable, compact), plain JSON elsewhere; every value written goes through
    `json_safe` first, so NaN and infinities (a diverged loss) are stored as null and never rejected."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Any) -> Any:
        return dialect.type_descriptor(JSONB() if dialect.name == "postgresql" else JSON())

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return json_safe(value)


JSONType = SafeJSON()


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A public id such as `job_3k9...`: a type prefix and 16 random url-safe characters."""
    return f"{prefix}_{secrets.token_hex(10)}"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("proj"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Limits (`peagle projects set`); NULL means unlimited / any queue.
    allowed_queues: Mapped[list[str] | None] = mapped_column(JSONType, nullable=True)
    max_running_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    storage_cap_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    # sha256 of the whole key: keys are 256-bit random, so a fast hash is enough and lookup is one index hit.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(24), doc="First characters of the key, for display.")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Dashboard sessions of this key carry it in their cookie; signing out replaces it, so a copied
    # cookie ends with the sign-out (NULL: no session was ever started).
    session_nonce: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (Index("ix_datasets_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ds"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    uri: Mapped[str] = mapped_column(Text, doc="Artifact key of the stored JSONL.")
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    num_records: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(32))
    prompts_only_records: Mapped[int] = mapped_column(
        Integer,
        server_default="0",
        doc="Conversations without an assistant turn: a job must set dataset.regenerate to train on them.",
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # Keyset pagination walks (project_id, created_at, id) newest first; ?status= uses the second.
        Index("ix_jobs_project_created", "project_id", "created_at", "id"),
        Index("ix_jobs_project_status_created", "project_id", "status", "created_at", "id"),
        Index("ix_jobs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType, doc="The resolved spec, every default filled in.")
    spec_submitted: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType,
        nullable=True,
        doc="The spec as its user sent it (unset fields left out): what the worker runs.",
    )
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    queue: Mapped[str] = mapped_column(String(64), default="default")
    rq_job_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    worker_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    resume_uri: Mapped[str | None] = mapped_column(
        Text, nullable=True, doc="Artifact key of the newest mirrored training checkpoint (the resume point)."
    )
    resume_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gang: Mapped[dict[str, Any] | None] = mapped_column(
        JSONType,
        nullable=True,
        doc="A multi-node attempt's rendezvous, recorded by its leader: attempt, endpoint, nnodes, and what "
        "the other machines train with (spec, prepared data, cache, work directory).",
    )
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class JobNode(Base):
    """A machine that joined one attempt of a multi-node job besides its leader (node 0)."""

    __tablename__ = "job_nodes"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "slot", name="uq_job_nodes_job_attempt_slot"),)

    id: Mapped[int] = _serial_id()
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    slot: Mapped[int] = mapped_column(
        Integer, doc="Which of the leader's join requests (1..nodes-1) it took."
    )
    worker_name: Mapped[str] = mapped_column(String(200))
    joined_at: Mapped[datetime] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    left_at: Mapped[datetime | None] = mapped_column(
        UTCDateTime(), nullable=True, doc="Set when its torchrun ended (a killed node never sets it)."
    )
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = _serial_id()
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    level: Mapped[str] = mapped_column(String(16), default="info")
    type: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (Index("ix_job_metrics_job_id_step", "job_id", "step"),)

    id: Mapped[int] = _serial_id()
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        Index("ix_checkpoints_job_id_step", "job_id", "step"),
        Index("ix_checkpoints_project_id", "project_id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text, doc="Artifact key of the published directory.")
    files: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, doc="[{name, size, sha256}]")
    sha256: Mapped[str] = mapped_column(String(64), doc="sha256 of the sorted file manifest.")
    size: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    servable: Mapped[str] = mapped_column(
        String(16),
        server_default="unverified",
        doc="verified: vLLM loaded it and reproduced the verifier's greedy output before publishing.",
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("project_id", "key", name="uq_idempotency_keys_project_key"),)

    id: Mapped[int] = _serial_id()
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64), doc="sha256 of the canonical request body.")
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Plan(Base):
    """A plan request (`POST /v1/jobs/plan`): queued for a worker, answered asynchronously, polled by id."""

    __tablename__ = "plans"
    __table_args__ = (
        Index("ix_plans_project_status", "project_id", "status"),
        Index("ix_plans_key_status", "key_hash", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("plan"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(
        String(64), doc="The API key that asked (plans are limited per key)."
    )
    queue: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="queued")  # queued, running, succeeded, failed
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deadline_at: Mapped[datetime] = mapped_column(
        UTCDateTime(), doc="Unfinished by then: failed, plan_timeout."
    )
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class StorageUsage(Base):
    """The storage ledger: bytes under one artifact key, charged to a project.

    One row per (key, job) reference: a key several jobs of a project reuse (prepared data, a cache) has a
    row per job and is counted once (its largest size); its files go when the last row does. Rows without
    a job belong to the project (datasets) or are upload reservations (`expires_at` set, `kind` reservation).
    """

    __tablename__ = "storage_usage"
    __table_args__ = (
        Index("ix_storage_usage_project_key", "project_id", "key"),
        Index("ix_storage_usage_job_id", "job_id"),
    )

    id: Mapped[int] = _serial_id()
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(
        String(1024), doc="Artifact key (file or directory) the bytes live under."
    )
    # No foreign key: the row must outlive the job's until its files are deleted (service.lifecycle).
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
