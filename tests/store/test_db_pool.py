"""make_engine's pool_size against a real PostgreSQL: threads that hold connections at once keep theirs open when the
pool is sized for them; past SQLAlchemy's default of 5, every use opens (and closes) a new server process."""

from __future__ import annotations

import threading

import pytest
from databases import postgres_database
from sqlalchemy import text

from sluice.api import db

THREADS, ROUNDS = 8, 10


@pytest.fixture(scope="module")
def url():
    with postgres_database("sluice_pool") as url:
        yield url


def backends_seen(engine) -> set[int]:
    """The server processes that THREADS threads used over ROUNDS rounds, each holding a connection at once."""
    pids, lock = set(), threading.Lock()
    together = threading.Barrier(THREADS, timeout=60)  # a thread that fails breaks it: the others raise, not hang

    def work() -> None:
        for _ in range(ROUNDS):
            together.wait()
            with engine.connect() as c:  # every thread holds one here at the same moment
                pid = c.execute(text("SELECT pg_backend_pid()")).scalar()
                together.wait()
            with lock:
                pids.add(pid)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.dispose()
    return pids


def test_a_pool_sized_for_the_threads_keeps_their_connections(url):
    assert len(backends_seen(db.make_engine(url, pre_ping=False, pool_size=THREADS))) == THREADS


def test_the_default_pool_reopens_connections_for_more_threads(url):
    # 5 kept; the other 3 threads' connections are closed after each use and opened again for the next
    assert len(backends_seen(db.make_engine(url, pre_ping=False))) > 5 + 3 * (ROUNDS - 1)


def test_the_worker_runs_enough_chunks_to_fill_max_num_seqs_twice():
    from sluice.worker.cli.worker import default_concurrency

    assert default_concurrency(256) == 16  # chunks of 32 fill max_num_seqs twice over
    assert default_concurrency(10) == 2


def test_the_api_keeps_a_connection_for_each_thread_running_its_routes():
    import anyio

    from sluice.api.server import API_THREADS

    async def threads() -> int:  # what FastAPI's sync routes run on
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    assert anyio.run(threads) == API_THREADS
