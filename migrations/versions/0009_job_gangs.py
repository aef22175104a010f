"""Multi-node jobs: the leader's rendezvous on the job row, and a row per machine that joined an attempt.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("gang", JSON, nullable=True))
    op.create_table(
        "job_nodes",
        sa.Column("id", BIGID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("worker_name", sa.String(200), nullable=False),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("left_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_nodes_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_job_nodes"),
        sa.UniqueConstraint("job_id", "attempt", "slot", name="uq_job_nodes_job_attempt_slot"),
    )


def downgrade() -> None:
    op.drop_table("job_nodes")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("gang")
