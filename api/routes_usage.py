"""/v1/usage (sluice): the caller's tokens, GPU-seconds and cost by UTC day and batch, over a time range."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query

from sluice.api import store
from sluice.api.auth import CallerDep
from sluice.api.deps import ServicesDep
from sluice.api.errors import ApiError
from sluice.api.rest_objects import UsageReport, UsageRow, UsageTotals

router = APIRouter(prefix="/v1/usage", tags=["usage"])
SUMMED = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "gpu_seconds", "cost")
MAX_TIME = 2**63 - 1  # the database takes a Python int as a BIGINT: a larger one fails the query


@router.get("", response_model=UsageReport, summary="sluice: usage by day and batch")
def usage(svc: ServicesDep, me: CallerDep, start_time: Annotated[int, Query(ge=0, le=MAX_TIME)] = 0,
          end_time: Annotated[int | None, Query(ge=0, le=MAX_TIME)] = None) -> UsageReport:
    """Results that finished in [start_time, end_time) (unix seconds; by default all of them up to now)."""
    end = int(time.time()) + 1 if end_time is None else end_time
    if end <= start_time:
        raise ApiError(400, f"end_time {end} must be later than start_time {start_time}", "end_time", "invalid_value")
    with svc.sessions.begin() as session:
        days = store.tenant_usage(session, me.tenant_id, start_time, end)
    rows = [UsageRow(**asdict(day)) for day in days]
    total = UsageTotals(**{name: sum(getattr(row, name) for row in rows) for name in SUMMED})
    return UsageReport(tenant=me.tenant, start_time=start_time, end_time=end, data=rows, total=total)
