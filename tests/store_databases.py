"""Fixtures of the store and CLI tests (their conftests import them): a PostgreSQL database of the test run's own
(dropped at the end) and a SQLite file, both migrated with `sluice.api.db.upgrade`; `engine` runs a test on each,
emptied first. Redis db 11, flushed."""

from __future__ import annotations

import pytest
from databases import postgres_database, redis_db
from sqlalchemy import text

from sluice.api import db
from sluice.api.tables import Base

REDIS_DB = 11


@pytest.fixture(scope="session")
def postgresql_engine():
    with postgres_database("sluice_test") as url:
        engine = db.make_engine(url)
        yield engine
        engine.dispose()


@pytest.fixture(scope="session")
def sqlite_engine(tmp_path_factory):
    engine = db.make_engine(f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'sluice.db'}")
    db.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request):
    engine = request.getfixturevalue(f"{request.param}_engine")
    _empty(engine)
    return engine


@pytest.fixture
def sessions(engine):
    return db.session_factory(engine)


def _empty(engine) -> None:
    tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        else:
            for table in tables:
                connection.execute(text(f"DELETE FROM {table}"))


@pytest.fixture
def broker(monkeypatch):
    """A Redis database of the tests' own, empty, named by SLUICE_BROKER_URL."""
    with redis_db(REDIS_DB) as client:
        monkeypatch.setenv("SLUICE_BROKER_URL", f"redis://127.0.0.1:6379/{REDIS_DB}")
        yield client
