"""Database setup: SQLite connections as the store needs them, migrations that build exactly the tables api.models
declares (on PostgreSQL and SQLite), and `sluice db upgrade`."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from api import db
from api.models import Base
from worker.cli import main


def test_sqlite_connections_use_wal_a_busy_timeout_and_foreign_keys(sqlite_engine):
    with sqlite_engine.connect() as connection:
        pragmas = [connection.exec_driver_sql(f"PRAGMA {p}").scalar() for p in ("journal_mode", "busy_timeout",
                                                                                "foreign_keys")]
    assert pragmas == ["wal", db.SQLITE_BUSY_TIMEOUT_MS, 1]


def test_migrations_match_models(engine):
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"render_as_batch": engine.dialect.name == "sqlite"})
        assert compare_metadata(context, Base.metadata) == []


def test_db_upgrade_command_is_repeatable_and_downgrades(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SLUICE_DATABASE_URL", url)
    assert main(["db", "upgrade"]) == 0
    assert main(["db", "upgrade"]) == 0
    assert "latest schema" in capsys.readouterr().err
    engine = db.make_engine(url)
    assert set(inspect(engine).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    config = Config(str(db.MIGRATIONS / "alembic.ini"))
    with engine.begin() as connection:  # the downgrade path works too
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert inspect(engine).get_table_names() == ["alembic_version"]
    engine.dispose()
