"""Figures for Prometheus, read from the database at scrape time: requests by model and status, token totals and
latency histograms over the result rows, and each live worker's latest KV-cache use.

The sums scan every result row at each scrape: exact across any number of API hosts and restarts, at a cost that
grows with the table (a second or so per few million results). A batch with no model (none was given and no line
was valid, so none named one that was checked) is left out: nothing of it ran, its error results hold no tokens or
latencies, and a series labelled model="" would name nothing an operator can act on.
"""

from __future__ import annotations

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from sluice.api.store.common import INDEXED_STATUSES
from sluice.api.store.workers import live_workers
from sluice.api.tables import Batch, EfficiencyWindow, Request, Result

HAS_MODEL = Batch.model != ""  # a batch whose every line failed validation may have none


def requests_by_status(session: Session, statuses: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """{(served model, status): number of requests}, for the given request statuses (queued or running: those the
    requests' partial indexes hold, and name in the SQL as they do, so that no scrape reads every request ever)."""
    if unknown := set(statuses) - set(INDEXED_STATUSES):
        raise ValueError(f"no index serves requests of status {sorted(unknown)}")
    of_status = or_(*(Request.status == INDEXED_STATUSES[status] for status in statuses))
    rows = session.execute(select(Batch.model, Request.status, func.count()).join(Batch, Batch.id == Request.batch_id)
                           .where(of_status, HAS_MODEL).group_by(Batch.model, Request.status))
    return {(model, status): count for model, status, count in rows}


def token_totals(session: Session) -> dict[str, tuple[int, int]]:
    """{served model: (prompt tokens, generated tokens)} over every result."""
    rows = session.execute(select(Batch.model, func.coalesce(func.sum(Result.prompt_tokens), 0),
                                  func.coalesce(func.sum(Result.completion_tokens), 0))
                           .join(Request, Request.id == Result.request_id).join(Batch, Batch.id == Request.batch_id)
                           .where(HAS_MODEL).group_by(Batch.model))
    return {model: (prompt, completion) for model, prompt, completion in rows}


def latency_histogram(session: Session, column, bounds: tuple[float, ...]) -> dict[str, tuple[list[int], float, int]]:
    """{served model: (cumulative count of results with `column` <= each bound, sum, count)}, nulls left out."""
    le = [func.sum(case((column <= bound, 1), else_=0)) for bound in bounds]
    rows = session.execute(select(Batch.model, *le, func.coalesce(func.sum(column), 0.0), func.count(column))
                           .join(Request, Request.id == Result.request_id).join(Batch, Batch.id == Request.batch_id)
                           .where(column.is_not(None), HAS_MODEL).group_by(Batch.model))
    return {model: ([int(c) for c in counts], float(total), count) for model, *counts, total, count in rows}


def kv_cache_use(session: Session) -> list[tuple[str, str, float]]:
    """(worker id, served model, KV-cache use 0..1) of each live worker's latest efficiency window."""
    figures = []
    for worker in live_workers(session):
        use = session.scalar(select(EfficiencyWindow.kv_cache_use).where(EfficiencyWindow.worker_id == worker.id)
                             .order_by(EfficiencyWindow.window_end.desc()).limit(1))
        if use is not None:
            figures.append((worker.id, worker.served_model_name, use))
    return figures
