"""The REST API, live: uvicorn in a thread on a free port, over a PostgreSQL database and a Redis db of its own.

Fixtures others can reuse (the end-to-end tests with a real worker); tests/servers.py's `serve_app(app)` serves any
app this way:
  api_database   session: the URL of a migrated PostgreSQL database of the test run's own
  api_broker     session: (URL, redis client) of Redis db 13, flushed
  api            function: an `Api` (url, sessions, celery, redis) over emptied tables and queues, served by one
                 uvicorn per session with TEST_SETTINGS
  tenant_key     function: tenant_key("acme") creates the tenant (if new) and returns a fresh API key
  openai_client  function: openai_client(key) is an `openai.OpenAI` on the server, without SDK retries
"""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from api_helpers import TEST_SETTINGS
from databases import postgres_database, redis_db
from servers import serve_app
from sqlalchemy import text

from sluice.api import db, store
from sluice.api.queue import make_app
from sluice.api.server import create_app
from sluice.api.tables import Base

REDIS_DB = 13


@dataclass
class Api:
    url: str  # http://127.0.0.1:PORT, without /v1
    sessions: object
    celery: object
    redis: object

    def count(self, table: str) -> int:
        with self.sessions.begin() as session:
            return session.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()

    def counts(self) -> dict[str, int]:
        """Rows in every table: what a refused request must leave unchanged."""
        return {t.name: self.count(t.name) for t in Base.metadata.sorted_tables}


@pytest.fixture(scope="session")
def api_database():
    with postgres_database("sluice_api") as url:
        yield url


@pytest.fixture(scope="session")
def api_broker():
    with redis_db(REDIS_DB) as client:
        yield f"redis://127.0.0.1:6379/{REDIS_DB}", client


@pytest.fixture(scope="session")
def api_session_server(api_database, api_broker):
    engine = db.make_engine(api_database)
    sessions = db.session_factory(engine)
    celery = make_app(api_broker[0])
    with serve_app(create_app(sessions, celery, TEST_SETTINGS)) as url:
        yield Api(url, sessions, celery, api_broker[1])
    engine.dispose()


@pytest.fixture
def api(api_session_server) -> Api:
    with api_session_server.sessions.begin() as session:
        tables = ", ".join(t.name for t in reversed(Base.metadata.sorted_tables))
        session.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    api_session_server.redis.flushdb()
    return api_session_server


@pytest.fixture
def tenant_key(api):
    def create(tenant: str = "acme") -> str:
        with api.sessions.begin() as session:
            owner = store.get_or_create_tenant(session, tenant)
            return store.create_api_key(session, owner.id)[1]
    return create


@pytest.fixture
def openai_client(api):
    def create(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=0)
    return create
