"""results name their batch and input line, for pages in finishing order; batches keep their files' sizes

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-07 06:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

FILE_SIZES = ("output_bytes", "error_bytes")
INDEX = "ix_results_batch_finished_line"


def upgrade() -> None:
    # null: not kept yet; the first metadata read of an ended batch keeps them, those already stored included
    for column in FILE_SIZES:
        op.add_column("batches", sa.Column(column, sa.BigInteger(), nullable=True))
    op.add_column("results", sa.Column("batch_id", sa.String(length=40), nullable=True))
    op.add_column("results", sa.Column("line", sa.Integer(), nullable=True))
    # the results already stored: their request's batch and line (a join on PostgreSQL; SQLite before 3.33 has no
    # UPDATE ... FROM, and looks each request up by its primary key instead)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE results SET batch_id = requests.batch_id, line = requests.line FROM requests "
                   "WHERE requests.id = results.request_id")
    else:
        op.execute("UPDATE results SET " + ", ".join(
            f"{column} = (SELECT requests.{column} FROM requests WHERE requests.id = results.request_id)"
            for column in ("batch_id", "line")))
    with op.batch_alter_table("results") as batch:
        batch.alter_column("batch_id", existing_type=sa.String(length=40), nullable=False)
        batch.alter_column("line", existing_type=sa.Integer(), nullable=False)
    op.create_index(INDEX, "results", ["batch_id", "finished_at", "line"], unique=False)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="results")
    with op.batch_alter_table("results") as batch:
        batch.drop_column("line")
        batch.drop_column("batch_id")
    # in place (SQLite 3.35+): batch mode's copy of the table would DROP the old batches, whose implicit DELETE
    # cascades, foreign keys on, to every request and result
    with op.batch_alter_table("batches", recreate="never") as batch:
        for column in reversed(FILE_SIZES):
            batch.drop_column(column)
