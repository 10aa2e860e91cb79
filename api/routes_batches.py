"""/v1/batches: create, read, list and cancel batches; and sluice's pages of results and efficiency windows.

A batch runs on the model its lines name (one per batch, as in OpenAI), or on one base model and LoRA adapters
served on it (a live worker registers each adapter with its base). That model must be known: listed in
SLUICE_MODELS, or served by a live worker; otherwise the batch is refused (400, model_not_found) and nothing is
stored. Listing known models in SLUICE_MODELS lets batches queue up while their workers are still starting.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from sluice.api import store
from sluice.api.auth import CallerDep, hold_key
from sluice.api.deps import ServicesDep
from sluice.api.dispatch import dispatch
from sluice.api.errors import ApiError, ErrorResponse
from sluice.api.rest_objects import BatchList, BatchObject, EfficiencyReport, EfficiencyWindowObject, ResultPage
from sluice.api.settings import Settings
from sluice.api.tables import Batch

router = APIRouter(prefix="/v1/batches", tags=["batches"])
END_TIMES = ("completed_at", "failed_at", "cancelled_at", "expired_at")
MAX_LINE = 2**31 - 1  # requests.line is an INTEGER: a larger `after` would fail the query, not miss


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None  # OpenAI's; sluice keeps output until the batch's data is deleted


@router.post("", response_model=BatchObject, summary="Create a batch from an uploaded file")
def create_batch(body: BatchCreate, svc: ServicesDep, me: CallerDep) -> dict:
    if body.output_expires_after is not None:  # refused, not ignored: a caller relying on it would keep data longer
        raise ApiError(400, "output_expires_after is not supported: sluice keeps a batch's output and error files "
                            "for as long as the batch", "output_expires_after", "unsupported_value")
    with svc.sessions.begin() as session:
        hold_key(session, me)
        batch, work = store.create_batch(session, me.tenant_id, body.input_file_id, endpoint=body.endpoint,
                                         completion_window=body.completion_window, metadata=body.metadata,
                                         max_lines=svc.settings.max_batch_lines,
                                         parents=adapter_parents(session, svc.settings))
        if work is not None:
            require_known_model(session, svc.settings, work.model, "model", 400)
        view = store.batch_view(session, batch)
        outbox = store.new_deliveries(session)
    dispatch(svc.celery, [work] if work else [], outbox)
    return view


@router.get("/{batch_id}", response_model=BatchObject, summary="Get a batch")
def get_batch(svc: ServicesDep, me: CallerDep, batch_id: str) -> dict:
    with svc.sessions.begin() as session:
        return store.batch_view(session, owned_batch(session, batch_id, me.tenant_id))


@router.get("", response_model=BatchList, summary="List batches, newest first")
def list_batches(svc: ServicesDep, me: CallerDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
    with svc.sessions.begin() as session:
        rows, has_more = store.list_batches(session, me.tenant_id, after, limit)
        data = [store.batch_view(session, row) for row in rows]
    return {"data": data, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
            "has_more": has_more}


@router.post("/{batch_id}/cancel", response_model=BatchObject, summary="Cancel a batch",
             responses={409: {"model": ErrorResponse}})
def cancel_batch(svc: ServicesDep, me: CallerDep, batch_id: str) -> dict:
    with svc.sessions.begin() as session:
        owned_batch(session, batch_id, me.tenant_id)
        view = store.batch_view(session, store.cancel_batch(session, batch_id, me.tenant_id))
        outbox = store.new_deliveries(session)
    dispatch(svc.celery, [], outbox)
    return view


@router.get("/{batch_id}/results", response_model=ResultPage, summary="sluice: finished results, in finishing order")
def batch_results(svc: ServicesDep, me: CallerDep, batch_id: str,
                  after: Annotated[int | None, Query(ge=0, le=MAX_LINE)] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
    """Output and error lines in the order their requests finished; `after` is the `last_line` of the previous page.
    A result committed late can slot in before the cursor: a poller that must see every result compares its count
    with the batch's request_counts and reads again from the start when short (api.client does)."""
    with svc.sessions.begin() as session:
        owned_batch(session, batch_id, me.tenant_id)
        data, has_more = store.result_page(session, batch_id, after, limit)
    return {"data": data, "has_more": has_more, "last_line": data[-1]["line"] if data else after}


@router.get("/{batch_id}/efficiency", response_model=EfficiencyReport,
            summary="sluice: the efficiency windows of the batch's model's workers while it ran")
def batch_efficiency(svc: ServicesDep, me: CallerDep, batch_id: str) -> EfficiencyReport:
    with svc.sessions.begin() as session:
        batch = owned_batch(session, batch_id, me.tenant_id)
        start = batch.in_progress_at or batch.created_at
        end = min((t for t in (getattr(batch, name) for name in END_TIMES) if t is not None), default=time.time())
        # an adapter's batch ran on its base model's engine, whose windows are recorded under the base's name
        engine_model = adapter_parents(session, svc.settings).get(batch.model, batch.model)
        windows = store.efficiency_windows(session, engine_model, start, end)
        data = [EfficiencyWindowObject.model_validate(w, from_attributes=True) for w in windows]
    return EfficiencyReport(batch_id=batch.id, model=batch.model, start=start, end=end, data=data)


def owned_batch(session: Session, batch_id: str, tenant_id: int) -> Batch:
    """The tenant's batch; another tenant's, or a single request's one-request batch, is not found."""
    if batch_id.startswith(store.REQUEST_PREFIX):
        raise store.NotFound(f"batch {batch_id} not found")
    return store.get_batch(session, batch_id, tenant_id)


def require_known_model(session: Session, settings: Settings, model: str, param: str, status: int) -> None:
    if model in settings.models or store.live_workers(session, model):
        return
    served = sorted(set(settings.models) | {w.served_model_name for w in store.live_workers(session)})
    raise ApiError(status, f"model {model!r} is not served here: no live worker serves it and SLUICE_MODELS does "
                           f"not list it (known: {', '.join(served) or 'none'})", param, "model_not_found")


def adapter_parents(session: Session, settings: Settings) -> dict[str, str]:
    """The LoRA adapters known to be served, each with its base model: configured ones and live workers'."""
    return {**settings.adapter_parents, **store.adapter_parents(session)}
