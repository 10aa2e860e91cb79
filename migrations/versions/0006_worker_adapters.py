"""workers.parent: a worker serving LoRA adapters registers a row per adapter, naming the base model it runs on

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("parent", sa.String(length=255), nullable=True))


def downgrade() -> None:
    # in place (SQLite 3.35+), as 0002's: a copy of the table would cascade to the workers' efficiency windows
    with op.batch_alter_table("workers", recreate="never") as batch:
        batch.drop_column("parent")
