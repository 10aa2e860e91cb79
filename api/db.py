"""The database connection: one SQLAlchemy engine and session factory from `SLUICE_DATABASE_URL`, and migrations.

PostgreSQL (`postgresql+psycopg://user@host/db`) is the shared system of record; SQLite (the default,
`sqlite:///./.sluice/sluice.db`) is the embedded single-host store. Every SQLite transaction starts with BEGIN
IMMEDIATE: the store's transactions read then write, and a deferred SQLite transaction that tries to upgrade its
read lock while another connection writes fails at once with "database is locked" instead of waiting.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_URL = "sqlite:///./.sluice/sluice.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def database_url() -> str:
    return os.environ.get("SLUICE_DATABASE_URL") or DEFAULT_URL


def make_engine(url: str | None = None, *, pre_ping: bool = True, pool_size: int | None = None) -> Engine:
    """`pre_ping=False` for a caller that retries a transaction whose connection turns out dead (the GPU worker's
    db): the ping is a round trip on every checkout, two for every chunk of requests. `pool_size`: PostgreSQL
    connections kept open (SQLAlchemy's default 5), for a process with more threads in transactions at once: past
    it, each connection is opened for one use and closed, a new server process every time, and psycopg's prepared
    statements are lost with it."""
    url = make_url(url or database_url())
    # the drivers' own executemany wrote a batch's request rows faster than SQLAlchemy's pages of
    # multi-row VALUES, whose long SQL psycopg parses again for every page (bulk rows now go by COPY on PostgreSQL,
    # store.insert_rows; the other multi-row inserts, and SQLite's, still take this path)
    if url.get_backend_name() != "sqlite":
        sized = {} if pool_size is None else {"pool_size": pool_size}
        return create_engine(url, pool_pre_ping=pre_ping, use_insertmanyvalues=False, **sized)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, use_insertmanyvalues=False)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # let the "begin" hook below issue BEGIN, not the sqlite3 module
        for pragma in ("journal_mode = WAL", f"busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}", "foreign_keys = ON"):
            dbapi_connection.execute(f"PRAGMA {pragma}")

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit; use `with factory.begin() as session:` for a transaction."""
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config():
    """Alembic's configuration of the migrations shipped in the package (sluice.migrations), installed or not."""
    from alembic.config import Config

    # a wheel installs them as plain files, which alembic needs: it reads its scripts from a directory
    return Config(str(resources.files("sluice.migrations") / "alembic.ini"))


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the Alembic migrations shipped in the package."""
    from alembic import command

    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
