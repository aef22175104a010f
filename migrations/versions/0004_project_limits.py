"""Project limits: allowed queues, maximum concurrently running jobs, storage cap (NULL: unlimited).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.add_column(sa.Column("allowed_queues", JSON, nullable=True))
        batch.add_column(sa.Column("max_running_jobs", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("storage_cap_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.drop_column("storage_cap_bytes")
        batch.drop_column("max_running_jobs")
        batch.drop_column("allowed_queues")
