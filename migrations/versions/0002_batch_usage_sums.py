"""batches keep the sums of their results' usage

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07 05:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SUMS = {"usage_prompt_tokens": ("prompt_tokens", sa.BigInteger()),
        "usage_cached_tokens": ("cached_tokens", sa.BigInteger()),
        "usage_completion_tokens": ("completion_tokens", sa.BigInteger()),
        "usage_gpu_seconds": ("gpu_seconds", sa.Double()),
        "usage_cost": ("cost", sa.Double())}


def upgrade() -> None:
    for column, (_, kind) in SUMS.items():
        op.add_column("batches", sa.Column(column, kind, server_default="0", nullable=False))
    # the batches already stored: their sums from their results, as the store computed them until now
    op.execute("UPDATE batches SET " + ", ".join(
        f"{column} = COALESCE((SELECT SUM(results.{source}) FROM results JOIN requests ON requests.id = "
        f"results.request_id WHERE requests.batch_id = batches.id), 0)" for column, (source, _) in SUMS.items()))


def downgrade() -> None:
    # in place (SQLite 3.35+): batch mode's copy of the table would DROP the old batches, whose implicit DELETE
    # cascades, foreign keys on, to every request and result
    with op.batch_alter_table("batches", recreate="never") as batch:
        for column in SUMS:
            batch.drop_column(column)
