"""One reconciliation pass: expire overdue batches, and send again the requests whose message was lost.

Redis carries messages, not truth. A request lost its message when its worker died (the lease ran out) or when it
sits queued while its model's queue holds no message at all (Redis restarted or was flushed). Every store call
below stamps what it returns as published in the same transaction, so concurrent reconcilers never double-send.
"""

from __future__ import annotations

import logging

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from api import store
from api.queue import model_queue, publish_chunks, queue_depth

log = logging.getLogger(__name__)
STALE_SECONDS = 30.0  # a queued request published this long ago, in an empty queue, has lost its message


def reconcile_once(sessions: sessionmaker[Session], app: Celery, stale_seconds: float = STALE_SECONDS) -> int:
    """Returns the number of messages published."""
    with sessions.begin() as session:
        expired = store.expire_batches(session)
        work = store.recover_expired_leases(session)
        idle = [m for m in store.models_with_queued_requests(session) if queue_depth(app, model_queue(m)) == 0]
        work += store.republish_stale(session, stale_seconds, models=idle)
    sent = publish_chunks(app, work) if work else 0
    if expired or sent:
        log.info("reconcile: expired %d batches, re-sent %d requests in %d messages", len(expired),
                 sum(len(w.request_ids) for w in work), sent)
    return sent
