"""The queue commands against PostgreSQL and SQLite: the fixtures of tests/store_databases.py."""

from store_databases import broker, engine, postgresql_engine, sessions, sqlite_engine  # noqa: F401
