"""Accounting: what a GPU-second costs, and token and GPU-time sums per batch and per tenant and day."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from sluice.api.env import float_setting
from sluice.api.tables import Batch, Request, Result

DAY_SECONDS = 86_400


def gpu_hour_cost() -> float:
    """SLUICE_GPU_HOUR_COST, the price of one GPU-hour in the operator's currency (default 0: not priced)."""
    return float_setting("SLUICE_GPU_HOUR_COST", os.environ.get("SLUICE_GPU_HOUR_COST", "0"), lambda price: price >= 0,
                         "give the price of one GPU-hour as a number >= 0")


def cost(gpu_seconds: float, hour_cost: float | None = None) -> float:
    """The price of `gpu_seconds` at `hour_cost` (default: gpu_hour_cost(), read again: give it to price many)."""
    return gpu_seconds * (gpu_hour_cost() if hour_cost is None else hour_cost) / 3600


def _sums():
    return (func.count(Result.request_id), func.coalesce(func.sum(Result.prompt_tokens), 0),
            func.coalesce(func.sum(Result.cached_tokens), 0), func.coalesce(func.sum(Result.completion_tokens), 0),
            func.coalesce(func.sum(Result.gpu_seconds), 0.0), func.coalesce(func.sum(Result.cost), 0.0))


def batch_usage(batch: Batch) -> dict:
    """The batch's `usage`: OpenAI's token fields, the sums over its results that the batch keeps, plus sluice's
    gpu_seconds and cost."""
    prompt, completion = batch.usage_prompt_tokens, batch.usage_completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": batch.usage_cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion, "gpu_seconds": batch.usage_gpu_seconds, "cost": batch.usage_cost}


@dataclass
class DayUsage:
    day: str  # YYYY-MM-DD, UTC, of when the results finished
    batch_id: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_seconds: float
    cost: float


def tenant_usage(session: Session, tenant_id: int, start: float, end: float) -> list[DayUsage]:
    """The tenant's results finished in [start, end), summed by UTC day and batch."""
    day = _day(session)
    rows = session.execute(
        select(day, Request.batch_id, *_sums()).join(Request, Request.id == Result.request_id)
        .join(Batch, Batch.id == Request.batch_id)
        .where(Batch.tenant_id == tenant_id, Result.finished_at >= start, Result.finished_at < end)
        .group_by(day, Request.batch_id).order_by(day, Request.batch_id)).all()
    return [DayUsage(_date(d), batch_id, *sums) for d, batch_id, *sums in rows]


def _day(session: Session):
    """Days since the epoch of a result's finish: PostgreSQL's CAST rounds, SQLite's truncates (which is floor here:
    times are positive), and SQLite may lack floor()."""
    days = Result.finished_at / DAY_SECONDS
    return func.floor(days) if session.get_bind().dialect.name == "postgresql" else cast(days, Integer)


def _date(day: float) -> str:
    return datetime.datetime.fromtimestamp(int(day) * DAY_SECONDS, datetime.timezone.utc).date().isoformat()
