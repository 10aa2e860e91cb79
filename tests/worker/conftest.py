"""A real deployment in miniature: a PostgreSQL database and a Redis db of this module's own, and `sluice worker`
processes on a tiny model, started and killed by the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from databases import postgres_database, redis_db
from lora_fixtures import lora_dir  # noqa: F401
from sqlalchemy import select, text

from sluice.api import db, store
from sluice.api.queue import make_app, publish_chunks
from sluice.api.tables import Base, Request, Result

MODEL = "tiny"
REDIS_DB = 12
WORKER_FLAGS = ["--served-model-name", MODEL, "--lease-seconds", "3", "--reconcile-seconds", "1",
                "--stale-seconds", "3", "--shutdown-grace-seconds", "5", "--num-kv-blocks", "256",
                "--loglevel", "WARNING"]


@pytest.fixture(scope="module")
def services():
    with postgres_database("sluice_worker") as url, redis_db(REDIS_DB) as client:
        yield url, f"redis://127.0.0.1:6379/{REDIS_DB}", client


@dataclass
class Cluster:
    database_url: str
    broker_url: str
    redis: object
    model_dir: Path
    logs: Path
    workers: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        self.engine = db.make_engine(self.database_url)
        self.sessions = db.session_factory(self.engine)
        self.app = make_app(self.broker_url)

    def env(self) -> dict:
        return {**os.environ, "SLUICE_DATABASE_URL": self.database_url, "SLUICE_BROKER_URL": self.broker_url,
                "SLUICE_GPU_HOUR_COST": "3.6", "SLUICE_CHUNK_SIZE": "4"}

    def start_worker(self, *flags: str) -> subprocess.Popen:
        log = (self.logs / f"worker-{len(self.workers)}.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--model", str(self.model_dir),
                                 *WORKER_FLAGS, *flags], env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        self.workers.append(proc)
        return proc

    def wait_live(self, count: int, timeout: float = 90) -> None:
        def live():
            with self.sessions.begin() as s:
                return len(store.live_workers(s, MODEL)) >= count
        self.wait(live, timeout, f"{count} live workers")

    def submit(self, lines: list[dict], **kwargs) -> str:
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        with self.sessions.begin() as s:
            batch, work = store.submit_jsonl(s, "acme", "in.jsonl", data, model=MODEL, **kwargs)
        if work:
            publish_chunks(self.app, [work], size=4)
        return batch.id

    def batch(self, batch_id: str) -> dict:
        with self.sessions.begin() as s:
            return store.batch_view(s, store.get_batch(s, batch_id))

    def wait_status(self, batch_id: str, statuses: tuple[str, ...], timeout: float = 120) -> dict:
        self.wait(lambda: self.batch(batch_id)["status"] in statuses, timeout, f"batch in {statuses}")
        return self.batch(batch_id)

    def wait_finished(self, batch_id: str, at_least: int, timeout: float = 120) -> None:
        self.wait(lambda: self.finished(batch_id) >= at_least, timeout, f"{at_least} finished requests")

    def finished(self, batch_id: str) -> int:
        counts = self.batch(batch_id)["request_counts"]
        return counts["completed"] + counts["failed"]

    def results(self, batch_id: str) -> dict[str, dict]:
        with self.sessions.begin() as s:
            return {line["custom_id"]: line for line in store.output_lines(s, batch_id)}

    def errors(self, batch_id: str) -> dict[str, dict]:
        with self.sessions.begin() as s:
            return {line["custom_id"]: line for line in store.error_lines(s, batch_id)}

    def result_rows(self, batch_id: str) -> list:
        with self.sessions.begin() as s:
            return s.execute(select(Result).join(Request, Request.id == Result.request_id)
                             .where(Request.batch_id == batch_id)).scalars().all()

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            for proc in self.workers:
                assert proc.poll() is None or proc.returncode in (0, -9, -15), self.log_tail()
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(self.logs.glob("*.log")))

    def log_text(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        self.engine.dispose()


@pytest.fixture
def cluster(services, llama_dir, tmp_path):
    url, broker, client = services
    client.flushdb()
    engine = db.make_engine(url)
    with engine.begin() as connection:
        tables = ", ".join(t.name for t in reversed(Base.metadata.sorted_tables))
        connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()
    c = Cluster(url, broker, client, llama_dir, tmp_path)
    yield c
    c.stop()
