"""Checkpoints record whether vLLM served them before they were published (the publish gate).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Checkpoints published before the gate existed were never loaded in vLLM: "unverified".
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(
            sa.Column("servable", sa.String(length=16), nullable=False, server_default="unverified")
        )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("servable")
