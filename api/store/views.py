"""What users read: the OpenAI Batch object, the output and error files streamed from the result rows, pages of
results in the order they finished, and a single request with its result.

The files are views: they exist as soon as a batch has a result of their kind, grow while it runs (partial
downloads), and are ordered by input line, in the line format of `sluice run` (api.results.output_line/error_line).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import suppress

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from sluice.api.batch_lines import LineError
from sluice.api.results import error_line, output_line
from sluice.api.store.common import BATCHES, REQUEST_PREFIX, InvalidInput, NotFound
from sluice.api.store.ids import findable
from sluice.api.store.usage import batch_usage
from sluice.api.store.workers import live_workers
from sluice.api.tables import Batch, Request, Result

OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"
STREAM_ROWS = 500
# a batch's final statuses (lifecycle.py, and batches.py's failed): no transaction adds a result to a batch in one,
# since each that does (leases.FINISH, lifecycle.expire_batches, recovery._fail_exhausted) takes only requests of an
# in_progress or cancelling batch, under that batch's lock; so its files are final, and their sizes can be kept
ENDED = ("completed", "failed", "expired", "cancelled")
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")


def output_file_id(batch_id: str) -> str:
    return OUTPUT_PREFIX + batch_id


def error_file_id(batch_id: str) -> str:
    return ERROR_PREFIX + batch_id


def view_file(file_id: str) -> tuple[str, str] | None:
    """("output" or "error", batch id) for the id of a batch's output or error file, else None."""
    for kind, prefix in (("output", OUTPUT_PREFIX), ("error", ERROR_PREFIX)):
        if file_id.startswith(prefix):
            return kind, file_id.removeprefix(prefix)
    return None


def owned_view(session: Session, file_id: str, tenant_id: int) -> tuple[str, Batch] | None:
    """("output" or "error", its batch) for the id of an output or error file of one of the tenant's batches; None
    for any other id. A view of no batch of the tenant's (or of a single request's) is a file not found."""
    if (view := view_file(file_id)) is None:
        return None
    kind, batch_id = view
    if not batch_id.startswith(REQUEST_PREFIX):
        with suppress(NotFound):
            return kind, get_batch(session, batch_id, tenant_id)
    raise NotFound(f"file {file_id} not found")


def get_batch(session: Session, batch_id: str, tenant_id: int | None = None) -> Batch:
    """The batch, if it exists and (when tenant_id is given) belongs to that tenant: another's is not found."""
    batch = session.get(Batch, batch_id) if findable(batch_id) else None
    if batch is None or (tenant_id is not None and batch.tenant_id != tenant_id):
        raise NotFound(f"batch {batch_id} not found")
    return batch


def batch_view(session: Session, batch: Batch) -> dict:
    """The OpenAI Batch object, plus sluice's usage.gpu_seconds and usage.cost, `waiting_for_worker`: true while
    requests are queued for a model that no live worker serves, and `system_fingerprints`: its responses' distinct
    system_fingerprint values, sorted."""
    unfinished = batch.request_total - batch.request_completed - batch.request_failed
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": output_file_id(batch.id) if batch.request_completed else None,
        "error_file_id": error_file_id(batch.id) if batch.request_failed else None,
        **{name: None if getattr(batch, name) is None else int(getattr(batch, name)) for name in TIMESTAMPS},
        "request_counts": {"total": batch.request_total, "completed": batch.request_completed,
                           "failed": batch.request_failed},
        "metadata": batch.metadata_, "usage": batch_usage(batch),
        "waiting_for_worker": batch.status == "in_progress" and unfinished > 0
                              and not live_workers(session, batch.model),
        "system_fingerprints": batch.system_fingerprints or [],
    }


def output_lines(session: Session, batch_id: str) -> Iterator[dict]:
    """The output file's lines (successful requests) finished so far, in input order."""
    for line, custom_id, response in _finished(session, batch_id, Result.status_code == 200,
                                               Request.line, Request.custom_id, Result.response):
        yield _output_line(batch_id, line, custom_id, response)


def error_lines(session: Session, batch_id: str) -> Iterator[dict]:
    """The error file's lines (invalid lines and failed requests) finished so far, in input order."""
    for line, custom_id, error in _finished(session, batch_id, Result.status_code != 200,
                                            Request.line, Request.custom_id, Result.error):
        yield _error_line(batch_id, line, custom_id, error)


def result_page(session: Session, batch_id: str, after_line: int | None, limit: int) -> tuple[list[dict], bool]:
    """Up to `limit` results in the order they finished (then by line), following the result of input line
    `after_line`: output and error lines as in the files, each with its input `line` and `finished_at`; and whether
    more follow. A result committed late may finish before ones already paged past; see api.client for catching it."""
    stmt = (select(Result.line, Request.custom_id, Result.status_code, Result.response, Result.error,
                   Result.finished_at).join(Request, Request.id == Result.request_id)
            .where(Result.batch_id == batch_id))
    if after_line is not None:
        at = session.scalar(select(Result.finished_at).join(Request, Request.id == Result.request_id)
                            .where(Request.batch_id == batch_id, Request.line == after_line))
        if at is None:
            raise InvalidInput(f"after: line {after_line} has no result in batch {batch_id}", "after")
        stmt = stmt.where(tuple_(Result.finished_at, Result.line) > tuple_(at, after_line))
    # read from ix_results_batch_finished_line (batch_id, finished_at, line), in its order from the cursor on: a page
    # costs its own rows. Joined through requests instead, every page sorted all the batch's results (50,000: up to
    # 0.1 s); ordered by the single-column results.finished_at, PostgreSQL walked every batch's results since the first
    rows = session.execute(stmt.order_by(Result.finished_at, Result.line).limit(limit + 1)).all()
    records = [{**(_output_line(batch_id, line, custom_id, response) if status_code == 200
                   else _error_line(batch_id, line, custom_id, error)),
                "line": line, "finished_at": finished_at}
               for line, custom_id, status_code, response, error, finished_at in rows[:limit]]
    return records, len(rows) > limit


def request_view(session: Session, batch: Batch) -> dict:
    """A single request (a one-request batch): its status, and its response or error once finished."""
    request, result = session.execute(select(Request, Result).outerjoin(Result, Result.request_id == Request.id)
                                      .where(Request.batch_id == batch.id)).one()
    usage = None
    if result is not None:
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                 "total_tokens": result.prompt_tokens + result.completion_tokens,
                 "cached_tokens": result.cached_tokens, "gpu_seconds": result.gpu_seconds, "cost": result.cost}
    error = result.error if result is not None else None
    return {"id": batch.id, "object": "request", "endpoint": batch.endpoint, "model": batch.model,
            "status": request.status, "created_at": int(batch.created_at),
            "completed_at": None if result is None else int(result.finished_at),
            "response": None if result is None else result.response,
            "error": None if error is None else {k: error.get(k) for k in ("code", "message", "param")},
            "usage": usage}


def stable_id(prefix: str, batch_id: str, line: int) -> str:
    """The same id for a result line at every download (OpenAI's ids are stable too): derived, not stored."""
    return prefix + uuid.uuid5(uuid.NAMESPACE_URL, f"sluice:{prefix}{batch_id}:{line}").hex


def _output_line(batch_id: str, line: int, custom_id: str, response: dict) -> dict:
    return output_line(custom_id, response, stable_id("batch_req_", batch_id, line),
                       stable_id("req_", batch_id, line))


def _error_line(batch_id: str, line: int, custom_id: str | None, error: dict) -> dict:
    # a bad line's request row has no custom_id (see batches.py); its error keeps the one it gave
    return error_line(LineError(line, error["code"], error["message"],
                                custom_id if custom_id is not None else error.get("custom_id"), error["param"]),
                      stable_id("batch_req_", batch_id, line))


def file_page(session: Session, batch_id: str, kind: str, after_line: int, limit: int) -> list[tuple[int, dict]]:
    """Up to `limit` lines of the "output" or "error" file after input line `after_line`, as (line, file line): a
    download in pages, each in a transaction of its own."""
    if kind == "output":
        rows = _finished(session, batch_id, Result.status_code == 200, Request.line, Request.custom_id,
                         Result.response, after_line=after_line, limit=limit)
        return [(line, _output_line(batch_id, line, custom_id, response)) for line, custom_id, response in rows]
    rows = _finished(session, batch_id, Result.status_code != 200, Request.line, Request.custom_id, Result.error,
                     after_line=after_line, limit=limit)
    return [(line, _error_line(batch_id, line, custom_id, error)) for line, custom_id, error in rows]


def kept_file_bytes(batch: Batch, kind: str) -> int | None:
    """The byte size of the batch's "output" or "error" file as kept by keep_file_bytes, or None."""
    return batch.output_bytes if kind == "output" else batch.error_bytes


def keep_file_bytes(session: Session, batch: Batch, kind: str, size: int) -> int:
    """Keep `size`, the byte size of the batch's "output" or "error" file counted after `batch` was read, if the
    batch had ended by then: its file cannot change any more. Returns the size kept: the first host's to keep one
    (the same file, so the same number), or `size` for a batch that was still running."""
    if batch.status not in ENDED:
        return size
    column = BATCHES.output_bytes if kind == "output" else BATCHES.error_bytes
    session.execute(update(Batch.__table__).where(BATCHES.id == batch.id, column.is_(None)).values({column: size}))
    kept = session.scalar(select(column).where(BATCHES.id == batch.id))
    return size if kept is None else kept


def _finished(session: Session, batch_id: str, condition, *columns, after_line: int = 0, limit: int | None = None):
    stmt = (select(*columns).join(Result, Result.request_id == Request.id)
            .where(Request.batch_id == batch_id, Request.line > after_line, condition).order_by(Request.line)
            .limit(limit))
    yield from session.execute(stmt.execution_options(yield_per=STREAM_ROWS))
