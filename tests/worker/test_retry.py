"""worker.retry against a real PostgreSQL: a transaction whose pooled connection was killed runs again on a fresh
one, also when the database refuses connections for several seconds (a restart); an error that is not transient is
raised at once, without a second run."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from databases import admin_engine, postgres_database
from sqlalchemy import text
from sqlalchemy.exc import ProgrammingError

from sluice.api import db
from sluice.worker.retry import retry_transient


@pytest.fixture(scope="module")
def engine():
    with postgres_database("sluice_retry") as url:
        engine = db.make_engine(url, pre_ping=False)  # as the GPU worker's: nothing notices a dead connection early
        yield engine
        engine.dispose()


def backend_pid(engine) -> int:
    with engine.connect() as c:
        return c.execute(text("SELECT pg_backend_pid()")).scalar()


def test_a_transaction_on_a_killed_connection_runs_again_on_a_fresh_one(engine, caplog):
    old = backend_pid(engine)  # the pool keeps this connection
    with db.make_engine(engine.url.render_as_string(hide_password=False)).connect() as other:
        assert other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": old}).scalar()
    runs = []

    def transaction() -> int:
        runs.append(1)
        with engine.begin() as c:
            return c.execute(text("SELECT pg_backend_pid()")).scalar()

    with caplog.at_level(logging.WARNING, logger="sluice.worker.retry"):
        new = retry_transient(transaction)
    assert len(runs) == 2 and new != old
    assert "database error, retrying" in caplog.text


def test_an_error_that_is_not_transient_is_raised_at_once(engine):
    runs = []

    def transaction() -> None:
        runs.append(1)
        with engine.begin() as c:
            c.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(ProgrammingError, match="no_such_table"):
        retry_transient(transaction)
    assert len(runs) == 1


def test_a_database_down_for_several_seconds_is_waited_for(engine):
    """A restart refuses connections for seconds: a chunk whose result write gave up within them threw its results
    away and ran its requests again, an attempt more (the retries once lasted 3 s in all)."""
    name = engine.url.database
    admin = admin_engine()
    with admin.connect() as c:  # every connection dropped, and none accepted for 6 s
        c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        c.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name"), {"name": name})

    def back_up() -> None:
        with admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))

    timer = threading.Timer(6, back_up)
    timer.start()
    start = time.monotonic()
    try:
        assert retry_transient(lambda: backend_pid(engine)) > 0
    finally:
        timer.join()
        admin.dispose()
    assert time.monotonic() - start >= 5.5
