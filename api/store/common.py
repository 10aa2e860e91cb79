"""What the store modules share: the errors they raise, id prefixes, and the dialect-neutral pieces of SQL."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import JSON, ColumnElement, Select, Table, and_, bindparam, case, literal_column, or_, select, update
from sqlalchemy import insert as core_insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from sluice.api.store.ids import IdList, InIds
from sluice.api.tables import Batch, Request


class StoreError(Exception):
    """A request the store refuses; the message names the problem, and nothing stored was changed."""


class NotFound(StoreError):
    pass


class InvalidInput(StoreError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code  # code: the API error's, e.g. a batch line's unknown_parameter


class Conflict(InvalidInput):
    """A valid request that the object's current state refuses (cancelling a finished batch)."""


REQUEST_PREFIX = "req_"  # a single request's one-request batch: kept out of batch lists and batch webhooks


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def error_result(request_id: int, batch_id: str, line: int, status_code: int, error: dict[str, Any],
                 now: float) -> dict[str, Any]:
    """A result row for a request that ends in an error without running (bad line, expiry, lost workers); batch_id
    and line are its request's."""
    return {"request_id": request_id, "batch_id": batch_id, "line": line, "status_code": status_code,
            "response": None, "error": error, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
            "queue_seconds": None, "ttft_seconds": None, "e2e_seconds": None, "gpu_seconds": 0.0, "cost": 0.0,
            "worker_id": None, "finished_at": now}


def insert(session: Session, model):
    """INSERT with ON CONFLICT clauses, for PostgreSQL or SQLite, whichever the session is bound to."""
    dialect = session.get_bind().dialect.name
    return (postgresql if dialect == "postgresql" else sqlite).insert(model)


def insert_rows(session: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """Insert new rows, each with the same keys. On PostgreSQL by COPY: a batch's request rows and a chunk's results
    are the store's bulk writes, and an INSERT executed per row cost psycopg and the server each up to twice as much
    CPU per row (bench/NOTES.md). COPY has no ON CONFLICT: callers insert only rows that cannot exist yet."""
    if not rows:
        return
    if session.get_bind().dialect.name != "postgresql":
        session.execute(core_insert(table), rows)
        return
    columns = list(rows[0])
    as_json = [isinstance(table.c[name].type, JSON) for name in columns]
    sql = f"""COPY {table.name} ({', '.join(f'"{name}"' for name in columns)}) FROM STDIN"""
    with session.connection().connection.driver_connection.cursor() as cursor, cursor.copy(sql) as copy:
        for row in rows:  # JSON as its text, which the column's input parses; None stays SQL NULL (none_as_null)
            copy.write_row([json.dumps(row[name]) if is_json and row[name] is not None else row[name]
                            for name, is_json in zip(columns, as_json)])


# A worker's hot path runs the same few statements for every chunk. Built once at import with bound parameters,
# SQLAlchemy finds their compiled form by identity; built per call, each had its expression tree constructed, its
# cache key derived and looked up again: most of the store's Python time per request (bench/queue_overhead.py).
IDS = bindparam("ids", type_=IdList())  # one parameter, whatever the chunk size (store/ids.py)
NOW = bindparam("now")
OWNER = bindparam("owner")
# They name the tables' columns, not the ORM's attributes: a statement naming a mapped class goes through the ORM's
# statement handling on every execution, which cost about as much as the statement itself (bench/queue_overhead.py)
REQUESTS, BATCHES = Request.__table__.c, Batch.__table__.c
# Statuses the requests' partial indexes are over (tables.Request), written into the SQL: PostgreSQL uses such an
# index only where it sees that the query's status is the index's, which a bound parameter hides from the generic
# plan of a prepared statement
QUEUED, RUNNING = literal_column("'queued'"), literal_column("'running'")
INDEXED_STATUSES = {"queued": QUEUED, "running": RUNNING}


def lock_batches(session: Session, batch_ids: Select | list[str]) -> list[str]:
    """Lock batch rows, in id order, before touching their requests' statuses.

    Every transaction that finishes or cancels requests takes these locks first, so such transactions on one batch
    run one after another: the one that finishes the last request sees every other's work (no batch is left
    cancelling with nothing running), and lock order never inverts between them (no deadlock). SQLite needs none of
    this: its BEGIN IMMEDIATE serializes all writers.
    """
    rows = session.scalars(select(Batch.id).where(Batch.id.in_(batch_ids)).order_by(Batch.id).with_for_update())
    return list(rows)


LOCK_BATCHES_OF = (select(BATCHES.id).where(BATCHES.id.in_(select(REQUESTS.batch_id).where(InIds(REQUESTS.id, IDS))))
                   .order_by(BATCHES.id).with_for_update())


def lock_batches_of(session: Session, request_ids) -> list[str]:
    """lock_batches() for the batches of these requests."""
    return list(session.scalars(LOCK_BATCHES_OF, {"ids": list(request_ids)}))


def update_requests():
    """A Core UPDATE of the requests table: these paths hold no loaded Request objects, so the ORM has nothing to
    synchronize, and on a worker's hot path its handling costs more than the statement."""
    return update(Request.__table__)


def by_id(ids, *conditions) -> ColumnElement[bool]:
    """The requests named by `ids` (a list or IDS) that meet the conditions, always read through the primary key,
    whatever the planner's statistics say: the conditions go into one CASE expression, which no index can serve.
    With no statistics yet (a batch just inserted), PostgreSQL read the whole batch's status and batch_id index
    entries for every chunk instead, many times the primary key's cost (most of its CPU in bench/queue_overhead.py)."""
    named = InIds(REQUESTS.id, ids) if ids is IDS else REQUESTS.id.in_(ids)
    return and_(named, case((and_(*conditions), True), else_=False))


def batch_in(*statuses: str):
    # one comparison per status rather than in_(), whose list SQLAlchemy renders into the SQL on every execution
    return REQUESTS.batch_id.in_(select(BATCHES.id).where(or_(*(BATCHES.status == status for status in statuses))))


def lease_expired(now: float):
    return and_(REQUESTS.status == RUNNING, REQUESTS.lease_expires_at < now)


def held_or_free(worker_id: str, now: float):
    """Requests a worker may finish: running under its lease, never claimed, or abandoned by a dead worker."""
    return or_(and_(REQUESTS.status == "running", REQUESTS.lease_owner == worker_id), REQUESTS.status == "queued",
               lease_expired(now))
