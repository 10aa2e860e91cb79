"""batches.system_fingerprints: the distinct system_fingerprints of a batch's results, kept as they are written

Results stored before it carry no fingerprint, so the column starts null for every batch.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-21 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("system_fingerprints", sa.JSON(), nullable=True))


def downgrade() -> None:
    # in place (SQLite 3.35+), as 0002's: a copy of the table would cascade to the batches' requests
    with op.batch_alter_table("batches", recreate="never") as batch:
        batch.drop_column("system_fingerprints")
