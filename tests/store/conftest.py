"""Databases for the store tests: a PostgreSQL database of this session's own (dropped at the end) and a SQLite
file, both migrated with `api.db.upgrade`; `engine` runs a test on each, emptied first. Redis db 11, flushed."""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from api import db
from api.models import Base

POSTGRES_ADMIN_URLS = ("postgresql+psycopg://root@127.0.0.1:5432/postgres",
                       "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = "redis://127.0.0.1:6379/11"


def _admin_engine():
    for url in POSTGRES_ADMIN_URLS:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect():
                return engine
        except OperationalError:
            engine.dispose()
    pytest.skip("PostgreSQL is not reachable at 127.0.0.1:5432 as root or postgres (trust auth)")


@pytest.fixture(scope="session")
def postgres_url():
    admin = _admin_engine()
    name = f"sluice_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    yield admin.url.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def postgresql_engine(postgres_url):
    engine = db.make_engine(postgres_url)
    db.upgrade(engine)
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
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("Redis is not reachable at 127.0.0.1:6379")
    client.flushdb()
    monkeypatch.setenv("SLUICE_BROKER_URL", REDIS_URL)
    yield client
    client.flushdb()
    client.close()
