"""The worker's side of a request: claim it under a lease, keep the lease, give it back, or write its result.

Execution is at-least-once (a message can come twice, a worker can die mid-chunk); the stored result is exactly-once:
every status change is a conditional UPDATE, and a request is counted in its batch's request_counts by the one
transaction that moved it out of queued or running.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, select, update
from sqlalchemy.orm import Session

from sluice.api.store.common import (
    BATCHES,
    IDS,
    LOCK_BATCHES_OF,
    NOW,
    OWNER,
    REQUESTS,
    batch_in,
    by_id,
    held_or_free,
    insert_rows,
    lease_expired,
    lock_batches_of,
    update_requests,
)
from sluice.api.store.lifecycle import USAGE, count_and_settle, settle
from sluice.api.store.recovery import MAX_ATTEMPTS
from sluice.api.store.usage import cost, gpu_hour_cost
from sluice.api.tables import Batch, Result

ACCEPTING = ("in_progress", "cancelling")  # batches whose running requests may still finish
EXPIRES = bindparam("expires")


def _of_batch(column):
    """A column of the request's batch, as a scalar subquery: RETURNING of an UPDATE ... FROM may not name the joined
    table on SQLite, and a second statement for the batches cost a round trip per chunk."""
    return select(column).where(BATCHES.id == REQUESTS.batch_id).scalar_subquery()


# a request that already stopped MAX_ATTEMPTS workers is not run again: the reconciler fails it (recovery.py)
TAKE_OVER = lease_expired(NOW) & (REQUESTS.attempts < MAX_ATTEMPTS)
CLAIM = (update_requests()
         .where(by_id(IDS, (REQUESTS.status == "queued") | TAKE_OVER, batch_in("in_progress")))
         .values(status="running", attempts=REQUESTS.attempts + 1, lease_owner=OWNER, lease_expires_at=EXPIRES)
         .returning(REQUESTS.id, REQUESTS.batch_id, REQUESTS.custom_id, REQUESTS.line, REQUESTS.url, REQUESTS.body,
                    REQUESTS.attempts, REQUESTS.created_at, _of_batch(BATCHES.model), _of_batch(BATCHES.priority)))
RENEW = (update_requests()
         .where(by_id(IDS, REQUESTS.status == "running", REQUESTS.lease_owner == OWNER, batch_in("in_progress")))
         .values(lease_expires_at=EXPIRES).returning(REQUESTS.id))
FINISH = (update_requests().where(by_id(IDS, held_or_free(OWNER, NOW), batch_in(*ACCEPTING)))
          .values(status=bindparam("new_status"), lease_owner=None, lease_expires_at=None)
          .returning(REQUESTS.id, REQUESTS.batch_id, REQUESTS.line))
# lock_batches_of(), reading the batches' fingerprints in the same statement: write_results adds its results' ones
LOCK_WITH_FINGERPRINTS = LOCK_BATCHES_OF.add_columns(BATCHES.system_fingerprints)
SET_FINGERPRINTS = (update(Batch.__table__).where(BATCHES.id == bindparam("batch"))
                    .values(system_fingerprints=bindparam("fingerprints")))


@dataclass
class Claimed:
    """A request a worker now holds: what the engine needs, and the batch's model and priority."""

    id: int
    batch_id: str
    custom_id: str
    line: int
    url: str
    body: dict[str, Any]
    model: str
    priority: int
    attempts: int  # including this one
    created_at: float


@dataclass
class RequestResult:
    """What a worker reports for one request: a response body (status 200) or an error {code, message, param}."""

    request_id: int
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    status_code: int = 200
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None
    gpu_seconds: float = 0.0

    def __post_init__(self):
        if (self.response is None) == (self.error is None):
            raise ValueError(f"request {self.request_id}: give a response or an error, not both or neither")
        if (self.status_code == 200) != (self.response is not None):
            raise ValueError(f"request {self.request_id}: status_code {self.status_code} with "
                             f"{'a response' if self.response is not None else 'an error'}; 200 means a response")


def claim(session: Session | Connection, request_ids: list[int], worker_id: str,
          lease_seconds: float) -> list[Claimed]:
    """Take the requests that are queued, or running under an expired lease, in in_progress batches; the rest
    (finished, cancelled, held by a live worker, or that stopped MAX_ATTEMPTS workers) are skipped. Commit before
    running them. One statement: a connection in autocommit mode may run it."""
    now = time.time()
    rows = session.execute(CLAIM, {"ids": list(request_ids), "now": now, "owner": worker_id,
                                   "expires": now + lease_seconds}).all()
    return sorted((Claimed(i, batch_id, custom_id, line, url, body, model, priority, attempts, created_at)
                   for i, batch_id, custom_id, line, url, body, attempts, created_at, model, priority in rows),
                  key=lambda c: c.id)


def renew_leases(session: Session, request_ids: list[int], worker_id: str, lease_seconds: float) -> list[int]:
    """Extend the worker's leases on requests it is running; returns those it should abort instead: their batch is
    cancelling or expired, or another worker took them over after the lease ran out."""
    renewed = session.scalars(RENEW, {"ids": list(request_ids), "owner": worker_id,
                                      "expires": time.time() + lease_seconds}).all()
    return sorted(set(request_ids) - set(renewed))


def release(session: Session, request_ids: list[int], worker_id: str) -> list[int]:
    """Give back requests the worker will not finish (graceful shutdown): running -> queued, or cancelled in a
    cancelling batch. Their message is still the one the worker holds: requeue it rather than ack it. The claim's
    attempt is given back too: MAX_ATTEMPTS counts workers that died running a request, not restarts."""
    lock_batches_of(session, request_ids)
    queued = session.scalars(_running_under(request_ids, worker_id, "in_progress")
                             .values(status="queued", attempts=REQUESTS.attempts - 1, lease_owner=None,
                                     lease_expires_at=None)
                             .returning(REQUESTS.id)).all()
    return sorted([*queued, *_cancel_running(session, request_ids, worker_id)])


def mark_cancelled(session: Session, request_ids: list[int], worker_id: str) -> list[int]:
    """Record that the worker aborted these running requests of cancelling batches; the last one ends the batch."""
    lock_batches_of(session, request_ids)
    return _cancel_running(session, request_ids, worker_id)


def _running_under(request_ids: list[int], worker_id: str, batch_status: str):
    """An UPDATE of those of the requests that run under the worker's lease in a batch of that status."""
    return update_requests().where(by_id(request_ids, REQUESTS.status == "running",
                                         REQUESTS.lease_owner == worker_id, batch_in(batch_status)))


def _cancel_running(session: Session, request_ids: list[int], worker_id: str) -> list[int]:
    rows = session.execute(_running_under(request_ids, worker_id, "cancelling")
                           .values(status="cancelled", lease_owner=None, lease_expires_at=None)
                           .returning(REQUESTS.id, REQUESTS.batch_id)).all()
    now = time.time()
    for batch_id in sorted({batch_id for _, batch_id in rows}):
        settle(session, batch_id, now)
    return sorted(request_id for request_id, _ in rows)


def write_results(session: Session, results: list[RequestResult], worker_id: str) -> list[int]:
    """Store results and finish their requests in one transaction; returns the ids this call finished.

    A request is finished here only if it is still running under this worker's lease, or queued, or running under
    an expired lease, in an in_progress or cancelling batch; anything else (written before, expired, cancelled, taken
    over by another worker) is ignored, so a second write of the same result changes nothing. The batch counters
    grow by exactly the requests finished, and the write that finishes a batch's last request completes the batch.
    """
    by_id = {r.request_id: r for r in results}
    if not by_id:
        return []
    now = time.time()
    known = dict(session.execute(LOCK_WITH_FINGERPRINTS, {"ids": list(by_id)}).all())
    finished: list[tuple[int, str, int]] = []
    for status, ids in (("completed", [i for i, r in by_id.items() if r.error is None]),
                        ("failed", [i for i, r in by_id.items() if r.error is not None])):
        if ids:
            finished += session.execute(FINISH, {"ids": ids, "owner": worker_id, "now": now,
                                                 "new_status": status}).all()
    if not finished:
        return []
    # none of them has a result yet: a result is written only by the transaction that moves its request out of
    # queued or running, and FINISH moved these (under their row locks) in this one
    hour_cost = gpu_hour_cost()  # once a chunk: it reads and checks the environment variable
    rows = {i: _result_row(by_id[i], batch_id, line, worker_id, now, hour_cost) for i, batch_id, line in finished}
    insert_rows(session, Result.__table__, list(rows.values()))
    _add_fingerprints(session, known, rows.values())
    completed = Counter(b for i, b, _ in finished if by_id[i].error is None)
    failed = Counter(b for i, b, _ in finished if by_id[i].error is not None)
    usage: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(USAGE, 0))
    for request_id, batch_id, _ in finished:  # the rows just inserted, and only those: as the batch's sums
        for name in USAGE:
            usage[batch_id][name] += rows[request_id][name]
    for batch_id in sorted(set(completed) | set(failed)):
        count_and_settle(session, batch_id, completed[batch_id], failed[batch_id], now, usage[batch_id])
    return sorted(request_id for request_id, _, _ in finished)


def _add_fingerprints(session: Session, known: dict[str, list[str] | None], rows) -> None:
    """Add the responses' system_fingerprints that their batches do not list yet (the caller holds the batches'
    locks): a write only when a configuration first answers for a batch."""
    new: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        if row["response"] is not None and (fingerprint := row["response"].get("system_fingerprint")):
            new[row["batch_id"]].add(fingerprint)
    for batch_id, fingerprints in sorted(new.items()):
        listed = set(known.get(batch_id) or ())
        if not fingerprints <= listed:
            session.execute(SET_FINGERPRINTS, {"batch": batch_id, "fingerprints": sorted(listed | fingerprints)})


def _result_row(r: RequestResult, batch_id: str, line: int, worker_id: str, now: float,
                hour_cost: float) -> dict[str, Any]:
    """The result's row; batch_id and line are its request's (as FINISH returned them)."""
    return {"request_id": r.request_id, "batch_id": batch_id, "line": line, "status_code": r.status_code,
            "response": r.response, "error": r.error, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens,
            "queue_seconds": r.queue_seconds, "ttft_seconds": r.ttft_seconds, "e2e_seconds": r.e2e_seconds,
            "gpu_seconds": r.gpu_seconds, "cost": cost(r.gpu_seconds, hour_cost), "worker_id": worker_id,
            "finished_at": now}
