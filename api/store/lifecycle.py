"""A batch's status changes after creation: completion, cancellation, expiry; each a conditional UPDATE.

in_progress -> finalizing -> completed happens in the transaction that finishes the last request (output and error
files are views over the results, so finalizing takes no time); cancelling -> cancelled when nothing runs any more;
in_progress -> expired when the completion window passes. Each end writes its webhook outbox rows in the same
transaction.
"""

from __future__ import annotations

import time

from sqlalchemy import bindparam, exists, select, update
from sqlalchemy.orm import Session

from sluice.api.store.common import (
    BATCHES,
    NOW,
    REQUESTS,
    Conflict,
    NotFound,
    error_result,
    insert,
    lease_expired,
    lock_batches,
)
from sluice.api.store.webhooks import notify
from sluice.api.tables import Batch, Request, Result

EXPIRED_MESSAGE = "this request could not be executed before the completion window expired"
EXPIRED_STATUS_CODE = 408
CANCELLABLE = ("validating", "in_progress")
# run for every chunk a worker finishes, so built once (see common.IDS); they leave loaded Batch objects as they were
BATCH = bindparam("batch")
COMPLETE = (update(Batch.__table__)
            .where(BATCHES.id == BATCH, BATCHES.status == "in_progress",
                   BATCHES.request_completed + BATCHES.request_failed >= BATCHES.request_total)
            .values(status="completed", finalizing_at=NOW, completed_at=NOW).returning(BATCHES.tenant_id))
END_CANCELLING = (update(Batch.__table__)
                  .where(BATCHES.id == BATCH, BATCHES.status == "cancelling",
                         ~exists().where(REQUESTS.batch_id == BATCH, REQUESTS.status.in_(("queued", "running"))))
                  .values(status="cancelled", cancelled_at=NOW).returning(BATCHES.tenant_id))
USAGE = ("prompt_tokens", "cached_tokens", "completion_tokens", "gpu_seconds", "cost")  # a batch's usage_* sums
COUNT_FINISHED = (update(Batch.__table__).where(BATCHES.id == BATCH).values(
    request_completed=BATCHES.request_completed + bindparam("completed"),
    request_failed=BATCHES.request_failed + bindparam("failed"),
    **{f"usage_{name}": BATCHES[f"usage_{name}"] + bindparam(name) for name in USAGE})
    .returning(BATCHES.status, BATCHES.request_completed + BATCHES.request_failed >= BATCHES.request_total))


def settle(session: Session, batch_id: str, now: float) -> str | None:
    """End the batch if its last request just finished; returns the new status, or None. Caller holds its lock."""
    for statement, status in ((COMPLETE, "completed"), (END_CANCELLING, "cancelled")):
        tenant_id = session.scalar(statement, {"batch": batch_id, "now": now})
        if tenant_id is not None:
            notify(session, tenant_id, f"batch.{status}", batch_id, now)
            return status
    return None


def count_finished(session: Session, batch_id: str, completed: int, failed: int,
                   usage: dict[str, float] | None = None) -> tuple[str, bool]:
    """Add to the batch's counters and usage sums (USAGE: by name, none for error results); returns its status and
    whether every request has now finished."""
    params = {"batch": batch_id, "completed": completed, "failed": failed, **dict.fromkeys(USAGE, 0), **(usage or {})}
    status, done = session.execute(COUNT_FINISHED, params).one()
    return status, bool(done)


def count_and_settle(session: Session, batch_id: str, completed: int, failed: int, now: float,
                     usage: dict[str, float] | None = None) -> str | None:
    """count_finished(), then settle() only where it could end the batch: most chunks of a batch are not its last,
    and this runs for every chunk a worker finishes. Caller holds the batch's lock."""
    status, done = count_finished(session, batch_id, completed, failed, usage)
    if (status == "in_progress" and done) or status == "cancelling":
        return settle(session, batch_id, now)
    return None


def lock_in_id_order(session: Session, *conditions) -> None:
    """Lock the requests that meet the conditions in id order, before an UPDATE of them: the order a claim locks its
    chunk's rows in (by primary key). The UPDATE alone locks them in the order it scans, which is not id order once
    updates have moved rows, so a claim in flight and a cancel each waited for a row the other held: a deadlock,
    whose victim (the cancel) failed."""
    session.execute(select(Request.id).where(*conditions).order_by(Request.id).with_for_update()).all()


def cancel_batch(session: Session, batch_id: str, tenant_id: int | None = None) -> Batch:
    """in_progress -> cancelling: queued requests (and those of dead workers) are cancelled at once, running ones when
    their worker aborts or finishes them (finished ones are kept); cancelled as soon as none runs."""
    now = time.time()
    batch = session.get(Batch, batch_id, with_for_update=True, populate_existing=True)
    if batch is None or (tenant_id is not None and batch.tenant_id != tenant_id):
        raise NotFound(f"batch {batch_id} not found")
    if batch.status in ("cancelling", "cancelled"):
        return batch
    if batch.status not in CANCELLABLE:
        raise Conflict(f"batch {batch_id} is {batch.status}; only a validating or in_progress batch can be "
                       "cancelled", "batch_id")
    batch.status, batch.cancelling_at = "cancelling", now
    session.flush()
    doomed = (Request.batch_id == batch_id, (Request.status == "queued") | lease_expired(now))
    lock_in_id_order(session, *doomed)
    session.execute(update(Request).where(*doomed).values(status="cancelled", lease_owner=None, lease_expires_at=None))
    settle(session, batch_id, now)
    session.refresh(batch)
    return batch


def expire_batches(session: Session) -> list[str]:
    """Expire every in_progress batch whose completion window has passed: its unfinished requests get
    `batch_expired` error results and count as failed; a result written for them later changes nothing."""
    now = time.time()
    due = select(Batch.id).where(Batch.status == "in_progress", Batch.expires_at < now)
    expired = []
    for batch_id in lock_batches(session, due):
        tenant_id = session.scalar(update(Batch).where(Batch.id == batch_id, Batch.status == "in_progress")
                                   .values(status="expired", expired_at=now).returning(Batch.tenant_id))
        if tenant_id is None:
            continue
        unfinished = (Request.batch_id == batch_id, Request.status.in_(("queued", "running")))
        lock_in_id_order(session, *unfinished)
        rows = session.execute(update(Request).where(*unfinished)
                               .values(status="expired", lease_owner=None, lease_expires_at=None)
                               .returning(Request.id, Request.line)).all()
        if rows:
            session.execute(insert(session, Result).on_conflict_do_nothing(), [
                error_result(request_id, batch_id, line, EXPIRED_STATUS_CODE, {
                    "code": "batch_expired", "param": None, "message": f"line {line}: {EXPIRED_MESSAGE}"}, now)
                for request_id, line in rows])
        count_finished(session, batch_id, 0, len(rows))
        notify(session, tenant_id, "batch.expired", batch_id, now)
        expired.append(batch_id)
    return expired

