"""Plans answered asynchronously (a row per request) and the per-project storage ledger.

The ledger starts from the datasets and published checkpoints already stored.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "plans",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("project_id", sa.String(40), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", JSON, nullable=True),
        sa.Column("error", JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name="fk_plans_project_id_projects", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_plans"),
    )
    op.create_index("ix_plans_project_status", "plans", ["project_id", "status"])
    op.create_index("ix_plans_key_status", "plans", ["key_hash", "status"])
    op.create_table(
        "storage_usage",
        sa.Column("id", BIGID, autoincrement=True, nullable=False),
        sa.Column("project_id", sa.String(40), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name="fk_storage_usage_project_id_projects", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_storage_usage"),
    )
    op.create_index("ix_storage_usage_project_key", "storage_usage", ["project_id", "key"])
    op.create_index("ix_storage_usage_job_id", "storage_usage", ["job_id"])
    op.execute(
        "INSERT INTO storage_usage (project_id, kind, key, job_id, bytes, updated_at) "
        "SELECT project_id, 'dataset', uri, NULL, size, created_at FROM datasets"
    )
    op.execute(
        "INSERT INTO storage_usage (project_id, kind, key, job_id, bytes, updated_at) "
        "SELECT project_id, 'checkpoint', uri, job_id, size, created_at FROM checkpoints"
    )


def downgrade() -> None:
    op.drop_index("ix_storage_usage_job_id", table_name="storage_usage")
    op.drop_index("ix_storage_usage_project_key", table_name="storage_usage")
    op.drop_table("storage_usage")
    op.drop_index("ix_plans_key_status", table_name="plans")
    op.drop_index("ix_plans_project_status", table_name="plans")
    op.drop_table("plans")
