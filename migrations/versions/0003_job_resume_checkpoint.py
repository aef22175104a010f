"""Jobs remember their newest mirrored training checkpoint, so any worker can resume them.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("resume_uri", sa.Text(), nullable=True))
        batch.add_column(sa.Column("resume_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resume_step")
        batch.drop_column("resume_uri")
