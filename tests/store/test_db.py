"""Database setup: SQLite connections as the store needs them, migrations that build exactly the tables api.tables
declares (on PostgreSQL and SQLite), and `sluice db upgrade`."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from databases import postgres_database
from sqlalchemy import inspect, text

from sluice.api import db
from sluice.api.tables import Base
from sluice.worker.cli import main


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
    config = db.alembic_config()
    with engine.begin() as connection:  # the downgrade path works too
        config.attributes["connection"] = connection
        command.downgrade(config, "base")
    assert inspect(engine).get_table_names() == ["alembic_version"]
    engine.dispose()


def insert_two_batches(connection) -> None:
    """A tenant and two completed batches, batch_a and batch_b, in the columns every schema version has."""
    connection.execute(text("INSERT INTO tenants VALUES (1, 'acme', 0)"))
    for batch_id in ("batch_a", "batch_b"):
        connection.execute(text("INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, "
                                "model, priority, status, request_total, request_completed, request_failed, "
                                "created_at, expires_at) VALUES (:b, 1, '/v1/completions', 'file-x', '24h', 'tiny', 5, "
                                "'completed', 2, 2, 0, 0, 0)"), {"b": batch_id})


def test_the_usage_migration_sums_the_results_of_batches_already_stored(tmp_path):
    """0002 adds the batches' usage sums: a batch stored before it gets the sums of its results."""
    engine = db.make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    db.upgrade(engine, "0001")
    with engine.begin() as c:
        insert_two_batches(c)
        for request_id, batch_id, prompt, gpu in ((1, "batch_a", 10, 1.5), (2, "batch_a", 5, 0.25),
                                                  (3, "batch_b", 7, 2.0)):
            c.execute(text("INSERT INTO requests (id, batch_id, line, custom_id, url, body, status, attempts, "
                           "created_at) VALUES (:r, :b, :r, :r, '/v1/completions', '{}', 'completed', 1, 0)"),
                      {"r": request_id, "b": batch_id})
            c.execute(text("INSERT INTO results (request_id, status_code, prompt_tokens, cached_tokens, "
                           "completion_tokens, gpu_seconds, cost, finished_at) VALUES (:r, 200, :p, 1, 3, :g, :g, 0)"),
                      {"r": request_id, "p": prompt, "g": gpu})
    db.upgrade(engine)
    with engine.begin() as c:
        rows = c.execute(text("SELECT id, usage_prompt_tokens, usage_cached_tokens, usage_completion_tokens, "
                              "usage_gpu_seconds, usage_cost FROM batches ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("batch_a", 15, 2, 6, 1.75, 1.75), ("batch_b", 7, 1, 3, 2.0, 2.0)]
    engine.dispose()


def downgrade(engine, revision: str) -> None:
    config = db.alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


@contextmanager
def database_at(dialect: str, revision: str, tmp_path):
    """An empty database of that dialect migrated to `revision`."""
    if dialect == "sqlite":
        engine = db.make_engine(f"sqlite:///{tmp_path / 'old.db'}")
        db.upgrade(engine, revision)
        yield engine
        engine.dispose()
        return
    with postgres_database("sluice_migration") as url:  # migrated to the latest: back to `revision`
        engine = db.make_engine(url)
        downgrade(engine, revision)
        yield engine
        engine.dispose()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_the_results_migration_names_stored_results_batch_and_line_and_downgrades_keeping_them(dialect, tmp_path):
    """0003 gives the results stored before it their request's batch and line (what result pages read), leaves the
    batches' file sizes to be kept by their first read, and its downgrade keeps every row (on SQLite, a copy of the
    batches table would have cascaded its DROP to every request and result)."""
    with database_at(dialect, "0002", tmp_path) as engine:
        with engine.begin() as c:
            insert_two_batches(c)
            # request ids in another order than lines, and a request without a result
            for request_id, batch_id, line in ((1, "batch_a", 2), (2, "batch_a", 1), (3, "batch_b", 7),
                                               (4, "batch_b", 3)):
                c.execute(text("INSERT INTO requests (id, batch_id, line, custom_id, url, body, status, attempts, "
                               "created_at) VALUES (:r, :b, :l, :r, '/v1/completions', '{}', 'completed', 1, 0)"),
                          {"r": request_id, "b": batch_id, "l": line})
            for request_id in (1, 2, 3):
                c.execute(text("INSERT INTO results (request_id, status_code, prompt_tokens, cached_tokens, "
                               "completion_tokens, gpu_seconds, cost, finished_at) VALUES (:r, 200, 1, 0, 1, 0, 0, "
                               ":r)"), {"r": request_id})
        db.upgrade(engine)
        with engine.begin() as c:
            results = c.execute(text("SELECT request_id, batch_id, line FROM results ORDER BY request_id")).all()
            sizes = c.execute(text("SELECT output_bytes, error_bytes FROM batches")).all()
        assert [tuple(r) for r in results] == [(1, "batch_a", 2), (2, "batch_a", 1), (3, "batch_b", 7)]
        assert [tuple(s) for s in sizes] == [(None, None), (None, None)]
        indexes = {i["name"]: i["column_names"] for i in inspect(engine).get_indexes("results")}
        assert indexes["ix_results_batch_finished_line"] == ["batch_id", "finished_at", "line"]
        downgrade(engine, "0002")
        with engine.begin() as c:
            counts = [c.execute(text(f"SELECT count(*) FROM {table}")).scalar() for table in ("batches", "requests",
                                                                                             "results")]
        assert counts == [2, 4, 3]
        assert {"batch_id", "line"}.isdisjoint(c["name"] for c in inspect(engine).get_columns("results"))
        assert {"output_bytes", "error_bytes"}.isdisjoint(c["name"] for c in inspect(engine).get_columns("batches"))
        downgrade(engine, "0001")  # 0002's downgrade copied the batches table on SQLite, losing every request too
        with engine.begin() as c:
            counts = [c.execute(text(f"SELECT count(*) FROM {table}")).scalar() for table in ("batches", "requests",
                                                                                             "results")]
        assert counts == [2, 4, 3]
        assert "usage_cost" not in {c["name"] for c in inspect(engine).get_columns("batches")}


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_the_requests_status_indexes_hold_only_running_and_queued_requests_and_downgrade(dialect, tmp_path):
    """Migration 0005: the reconciler's indexes are partial, as api.tables declares them (autogenerate compares an
    index's columns, not its WHERE); its downgrade brings back the full ones."""
    def requests_indexes(engine) -> dict[str, tuple[list, str | None]]:
        found = {}
        for index in inspect(engine).get_indexes("requests"):
            where = index.get("dialect_options", {}).get(f"{dialect}_where")
            found[index["name"]] = (index["column_names"], where if where is None else str(where))
        return {name: value for name, value in found.items() if name.startswith("ix_")}

    with database_at(dialect, "head", tmp_path) as engine:
        indexes = requests_indexes(engine)
        assert set(indexes) == {"ix_requests_running_lease", "ix_requests_queued_published"}
        assert indexes["ix_requests_running_lease"][0] == ["lease_expires_at"]
        assert "'running'" in indexes["ix_requests_running_lease"][1]
        assert indexes["ix_requests_queued_published"][0] == ["published_at"]
        assert "'queued'" in indexes["ix_requests_queued_published"][1]
        downgrade(engine, "0004")
        assert requests_indexes(engine) == {"ix_requests_status_lease": (["status", "lease_expires_at"], None),
                                            "ix_requests_status_published": (["status", "published_at"], None)}
