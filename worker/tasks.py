"""Celery tasks: run a chunk of requests on this process's GPU worker, deliver a webhook, and reconcile.

Importing this never imports torch: the CPU worker (webhooks, maintenance) loads it too.
"""

from __future__ import annotations

import time
from functools import cache

from celery.exceptions import Reject
from sqlalchemy.orm import Session, sessionmaker

from sluice.api import db
from sluice.api.queue import DELIVER_WEBHOOK, RECONCILE, RUN_CHUNK
from sluice.api.webhooks import deliver
from sluice.worker.celery_app import app
from sluice.worker.reconcile import reconcile_once


@cache
def sessions() -> sessionmaker[Session]:
    return db.session_factory(db.make_engine())


@app.task(name=RUN_CHUNK)
def run_chunk(request_ids: list[int]) -> None:
    """Returns only once the chunk's results are committed: Celery acks the message after that (acks_late)."""
    from sluice.worker.gpu_worker import current  # the engine side, only in a GPU worker's process

    worker = current()
    if worker is None:
        raise Reject("this process has no engine: chunks are run by `sluice worker`", requeue=True)
    outcome = worker.run_chunk(request_ids)
    if outcome.released:  # stopping, or no engine running: the requests are queued again, and so is their message
        raise Reject(f"worker stopping or its engine not running: gave back {len(outcome.released)} requests",
                     requeue=True)


@app.task(name=RECONCILE)
def reconcile() -> int:
    return reconcile_once(sessions(), app)


@app.task(name=DELIVER_WEBHOOK)
def deliver_webhook(delivery_id: str) -> str:
    """One attempt; a failed one is tried again at its next_attempt_at (exponential backoff with jitter), and the
    reconciler's sweep re-publishes any due delivery whose message was lost."""
    outcome = deliver(sessions(), delivery_id)
    if outcome.status == "pending":
        deliver_webhook.apply_async(args=[delivery_id], countdown=max(outcome.next_attempt_at - time.time(), 0))
    return outcome.status
