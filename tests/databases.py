"""Real services for tests: a PostgreSQL database of the test run's own, migrated, and a Redis db number."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from sluice.api import db

POSTGRES_ADMIN_URLS = ("postgresql+psycopg://root@127.0.0.1:5432/postgres",
                       "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def admin_engine():
    for url in POSTGRES_ADMIN_URLS:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect():
                return engine
        except OperationalError:
            engine.dispose()
    pytest.skip("PostgreSQL is not reachable at 127.0.0.1:5432 as root or postgres (trust auth)")


@contextmanager
def postgres_database(prefix: str) -> Iterator[str]:
    """A new migrated database; yields its URL and drops it afterwards."""
    admin = admin_engine()
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    engine = db.make_engine(url)
    db.upgrade(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def redis_db(number: int) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=6379, db=number)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("Redis is not reachable at 127.0.0.1:6379")
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()
