"""The ``jobs`` table and its indexes (the job store's first schema).

Revision ID: 0001
Revises: none
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        # bytewise order on PostgreSQL too (collation "C"): ids sort in creation order on both backends
        sa.Column("id", sa.String(64).with_variant(sa.String(64, collation="C"), "postgresql"), primary_key=True),
        sa.Column("kind", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("progress", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("completed_at", sa.Float),
        sa.Column("expires_at", sa.Float),
        sa.Column("error", sa.JSON),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("worker", sa.String(256)),
        sa.Column("lease_until", sa.Float),
        sa.Column("result_file", sa.String(512)),
    )
    op.create_index("ix_jobs_owner_id", "jobs", ["owner", "id"])
    op.create_index("ix_jobs_status_id", "jobs", ["status", "id"])
    op.create_index("ix_jobs_status_lease_until", "jobs", ["status", "lease_until"])
    op.create_index("ix_jobs_expires_at", "jobs", ["expires_at"])


def downgrade() -> None:
    op.drop_table("jobs")
