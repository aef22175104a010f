"""Datasets record how many of their conversations have no assistant turn (prompts only).

Such a dataset trains only with `dataset.regenerate`; job creation checks this count instead of reading the
file again. Datasets uploaded before could not hold such rows: 0.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.add_column(sa.Column("prompts_only_records", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.drop_column("prompts_only_records")
