"""The queue commands against PostgreSQL and SQLite: the fixtures of tests/store_databases.py; LoRA adapters for
`sluice run`."""

from lora_fixtures import lora_dir  # noqa: F401
from store_databases import broker, engine, postgresql_engine, sessions, sqlite_engine  # noqa: F401
