"""What users read: the OpenAI Batch object, and the output and error files streamed from the result rows.

The files are views: they exist as soon as a batch has a result of their kind, grow while it runs (partial
downloads), and are ordered by input line, in the line format of `sluice run` (api.schemas.output_line/error_line).
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Batch, Request, Result
from api.schemas import LineError, error_line, output_line
from api.store.common import NotFound
from api.store.usage import batch_usage
from api.store.workers import live_workers

OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"
STREAM_ROWS = 500
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


def get_batch(session: Session, batch_id: str, tenant_id: int | None = None) -> Batch:
    """The batch, if it exists and (when tenant_id is given) belongs to that tenant: another's is not found."""
    batch = session.get(Batch, batch_id)
    if batch is None or (tenant_id is not None and batch.tenant_id != tenant_id):
        raise NotFound(f"batch {batch_id} not found")
    return batch


def batch_view(session: Session, batch: Batch) -> dict:
    """The OpenAI Batch object, plus sluice's usage.gpu_seconds and usage.cost, and `waiting_for_worker`: true while
    requests are queued for a model that no live worker serves."""
    unfinished = batch.request_total - batch.request_completed - batch.request_failed
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "model": batch.model,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": output_file_id(batch.id) if batch.request_completed else None,
        "error_file_id": error_file_id(batch.id) if batch.request_failed else None,
        **{name: None if getattr(batch, name) is None else int(getattr(batch, name)) for name in TIMESTAMPS},
        "request_counts": {"total": batch.request_total, "completed": batch.request_completed,
                           "failed": batch.request_failed},
        "metadata": batch.metadata_, "usage": batch_usage(session, batch.id),
        "waiting_for_worker": batch.status == "in_progress" and unfinished > 0
                              and not live_workers(session, batch.model),
    }


def output_lines(session: Session, batch_id: str) -> Iterator[dict]:
    """The output file's lines (successful requests) finished so far, in input order."""
    for custom_id, response in _finished(session, batch_id, Result.status_code == 200,
                                         Request.custom_id, Result.response):
        yield output_line(custom_id, response)


def error_lines(session: Session, batch_id: str) -> Iterator[dict]:
    """The error file's lines (invalid lines and failed requests) finished so far, in input order."""
    for line, custom_id, error in _finished(session, batch_id, Result.status_code != 200,
                                            Request.line, Request.custom_id, Result.error):
        # a bad line's request row has no custom_id (see batches.py); its error keeps the one it gave
        yield error_line(LineError(line, error["code"], error["message"],
                                   custom_id if custom_id is not None else error.get("custom_id"), error["param"]))


def _finished(session: Session, batch_id: str, condition, *columns):
    stmt = (select(*columns).join(Result, Result.request_id == Request.id)
            .where(Request.batch_id == batch_id, condition).order_by(Request.line))
    yield from session.execute(stmt.execution_options(yield_per=STREAM_ROWS))
