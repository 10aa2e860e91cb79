"""Celery tasks: run a chunk of requests on this process's GPU worker, and reconcile on the maintenance queue."""

from __future__ import annotations

from functools import cache

from celery.exceptions import Reject
from sqlalchemy.orm import Session, sessionmaker

from api import db
from api.queue import RECONCILE, RUN_CHUNK
from worker import gpu_worker
from worker.celery_app import app
from worker.reconcile import reconcile_once


@cache
def sessions() -> sessionmaker[Session]:
    return db.session_factory(db.make_engine())


@app.task(name=RUN_CHUNK)
def run_chunk(request_ids: list[int]) -> None:
    """Returns only once the chunk's results are committed: Celery acks the message after that (acks_late)."""
    worker = gpu_worker.current()
    if worker is None:
        raise Reject("this process has no engine: chunks are run by `sluice worker`", requeue=True)
    outcome = worker.run_chunk(request_ids)
    if outcome.released:  # stopping: the requests are queued again, and so is their message
        raise Reject(f"worker stopping: gave back {len(outcome.released)} requests", requeue=True)


@app.task(name=RECONCILE)
def reconcile() -> int:
    return reconcile_once(sessions(), app)
