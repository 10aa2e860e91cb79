"""Reconciliation: Redis carries messages, not truth, so requests that lost theirs are found here and sent again.

A request has lost its message when its worker died (its lease ran out and no message went out since) or when it has
waited, queued or under a lease that ran out, since a publish long ago (Redis restarted or flushed). Each query marks
what it returns as published now, in the same UPDATE, so two reconcilers never send the same request twice; publish
the returned work after commit.
"""

from __future__ import annotations

import time
from collections import defaultdict

from sqlalchemy import Row, or_, select, update
from sqlalchemy.orm import Session

from sluice.api.store.batches import Work
from sluice.api.store.common import QUEUED, batch_in, error_result, insert, lease_expired, lock_batches
from sluice.api.store.lifecycle import count_and_settle, settle
from sluice.api.tables import Batch, Request, Result

MAX_ATTEMPTS = 3  # workers that died running a request this many times: fail it rather than kill a fourth
WORKER_LOST_STATUS_CODE = 500


def recover_expired_leases(session: Session) -> list[Work]:
    """Requests whose worker's lease ran out: in in_progress batches they are returned to be published again (a claim
    takes an expired lease over), unless workers already died MAX_ATTEMPTS times running them: those fail, since they
    may be what kills the workers. In cancelling batches nobody will abort them, so they are cancelled here."""
    now = time.time()
    cancelling = select(Request.batch_id).where(lease_expired(now), batch_in("cancelling"))
    for batch_id in lock_batches(session, cancelling):
        session.execute(update(Request).where(Request.batch_id == batch_id, lease_expired(now))
                        .values(status="cancelled", lease_owner=None, lease_expires_at=None))
        settle(session, batch_id, now)
    _fail_exhausted(session, now)
    rows = session.execute(update(Request)
                           .where(lease_expired(now), Request.published_at < Request.lease_expires_at,
                                  batch_in("in_progress"))
                           .values(published_at=now).returning(Request.id, Request.batch_id)).all()
    return _work(session, rows)


def _fail_exhausted(session: Session, now: float) -> None:
    exhausted = (lease_expired(now), Request.attempts >= MAX_ATTEMPTS)
    for batch_id in lock_batches(session, select(Request.batch_id).where(*exhausted, batch_in("in_progress"))):
        rows = session.execute(update(Request).where(Request.batch_id == batch_id, *exhausted)
                               .values(status="failed", lease_owner=None, lease_expires_at=None)
                               .returning(Request.id, Request.line, Request.attempts)).all()
        if not rows:  # finished while we waited for its lock (a late write, a cancel, another reconciler)
            continue
        session.execute(insert(session, Result.__table__).on_conflict_do_nothing(), [
            error_result(request_id, batch_id, line, WORKER_LOST_STATUS_CODE, {
                "code": "worker_lost", "param": None,
                "message": f"line {line}: the worker running this request stopped {attempts} times (killed or "
                           "crashed); it is not tried again"}, now)
            for request_id, line, attempts in rows])
        count_and_settle(session, batch_id, 0, len(rows), now)


def republish_stale(session: Session, older_than: float, models: list[str] | None = None) -> list[Work]:
    """Waiting requests of in_progress batches (of `models`, if given) last published more than `older_than` seconds
    ago: queued ones, and running ones whose lease ran out (recover_expired_leases sent them once; that message can
    be lost too, or taken by a task that failed before its claim committed). Give only models whose queue is empty
    (or choose `older_than` above the longest time a message can wait): a request still waiting behind a long queue
    gets a second message, which is harmless (claims skip it) but wasted."""
    now = time.time()
    batches = select(Batch.id).where(Batch.status == "in_progress")
    if models is not None:
        batches = batches.where(Batch.model.in_(models))
    rows = session.execute(update(Request)
                           .where(_waiting(now), Request.published_at < now - older_than,
                                  Request.batch_id.in_(batches))
                           .values(published_at=now).returning(Request.id, Request.batch_id)).all()
    return _work(session, rows)


def models_with_waiting_requests(session: Session) -> list[str]:
    """Models of in_progress batches with waiting requests (queued, or running under a lease that ran out)."""
    return sorted(session.scalars(select(Batch.model).distinct()
                                  .where(Batch.status == "in_progress", Batch.id.in_(
                                      select(Request.batch_id).where(_waiting(time.time()))))))


def _waiting(now: float):
    """Requests that wait for a worker to take them: queued, or running under a lease that ran out."""
    return or_(Request.status == QUEUED, lease_expired(now))


def _work(session: Session, rows: list[Row]) -> list[Work]:
    by_batch: dict[str, list[int]] = defaultdict(list)
    for request_id, batch_id in rows:
        by_batch[batch_id].append(request_id)
    batches = session.execute(select(Batch.id, Batch.model, Batch.priority).where(Batch.id.in_(by_batch))
                              .order_by(Batch.id))
    return [Work(model, priority, sorted(by_batch[batch_id])) for batch_id, model, priority in batches]
