"""One reconciliation pass: expire overdue batches, send again the requests whose message was lost, and publish
the webhook deliveries that this pass wrote or that stayed due, unattempted, for stale_seconds (their message was
lost: a failed attempt's task sends the next one itself, with a countdown).

Redis carries messages, not truth. A request lost its message when its worker died (the lease ran out) or when it
waits (queued, or under a lease that ran out) while its model's queue holds no message at all (Redis restarted or
was flushed). Every store call below stamps what it returns as published in the same transaction, so concurrent
reconcilers never double-send.
"""

from __future__ import annotations

import logging
import time

from celery import Celery
from kombu.exceptions import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from sluice.api import store
from sluice.api.dispatch import dispatch
from sluice.api.queue import model_queue, queue_depth
from sluice.worker.retry import retry_transient

log = logging.getLogger(__name__)
STALE_SECONDS = 30.0  # a waiting request published this long ago, in an empty queue, has lost its message


def reconcile_once(sessions: sessionmaker[Session], app: Celery, stale_seconds: float = STALE_SECONDS) -> int:
    """Returns the number of chunk messages published."""
    idle = _idle_models(app, retry_transient(lambda: _waiting_models(sessions)))

    def transaction():
        with sessions.begin() as session:
            expired = store.expire_batches(session)
            work = store.recover_expired_leases(session)
            work += store.republish_stale(session, stale_seconds, models=idle)
            deliveries = store.new_deliveries(session) + store.due_deliveries(session, time.time(), stale_seconds)
        return expired, work, list(dict.fromkeys(deliveries))
    expired, work, deliveries = retry_transient(transaction)
    sent = dispatch(app, work, deliveries)  # a broker that is down is logged: what was stamped is re-sent later
    if expired or sent:
        log.info("reconcile: expired %d batches, re-sent %d requests in %d messages", len(expired),
                 sum(len(w.request_ids) for w in work), sent)
    return sent


def _waiting_models(sessions: sessionmaker[Session]) -> list[str]:
    with sessions.begin() as session:
        return store.models_with_waiting_requests(session)


def _idle_models(app: Celery, models: list[str]) -> list[str]:
    """The models whose queue holds no message. Asked before the pass's transaction, and none while the broker is
    unreachable (it takes seconds to say so): expiring batches and recovering leases must not wait on Redis, nor
    fail with it."""
    try:
        return [m for m in models if queue_depth(app, model_queue(m)) == 0]
    except OperationalError as e:
        log.warning("reconcile: cannot read the queues (%s); lost messages are re-sent once the broker is back", e)
        return []
