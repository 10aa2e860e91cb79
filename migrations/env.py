"""Alembic's entry point: migrates the database of SLUICE_DATABASE_URL, or the connection `api.db.upgrade` hands in."""

from alembic import context

from sluice.api import db
from sluice.api.tables import Base


def run_migrations(connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    with db.make_engine().begin() as connection:
        run_migrations(connection)
