"""deleted files keep their place in their tenant's file list, for the `after` cursor of the next page

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 10:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deleted_files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_deleted_files_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deleted_files")),
    )


def downgrade() -> None:
    op.drop_table("deleted_files")
