"""/v1/requests (sluice): one chat or completion body, answered with an id at once and polled until it finishes.

It is stored as a one-request batch of its own (id req_...), so it runs, is accounted and expires as a batch's line
does; it is not listed among batches and sends no batch webhooks. Its `body.model` must be a known model (404
model_not_found otherwise, as OpenAI answers an unknown model).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from sluice.api import store
from sluice.api.auth import CallerDep, hold_key
from sluice.api.deps import ServicesDep
from sluice.api.dispatch import dispatch
from sluice.api.rest_objects import RequestObject
from sluice.api.routes_batches import require_known_model

router = APIRouter(prefix="/v1/requests", tags=["requests"])


class RequestCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str
    body: dict[str, Any]


@router.post("", response_model=RequestObject, summary="sluice: queue one chat or completion request")
def create_request(request: RequestCreate, svc: ServicesDep, me: CallerDep) -> dict:
    with svc.sessions.begin() as session:
        hold_key(session, me)
        batch, work = store.create_request(session, me.tenant_id, request.endpoint, request.body)
        require_known_model(session, svc.settings, work.model, "body.model", 404)
        view = store.request_view(session, batch)
    dispatch(svc.celery, [work], [])
    return view


@router.get("/{request_id}", response_model=RequestObject, summary="sluice: a single request and its result")
def get_request(svc: ServicesDep, me: CallerDep, request_id: str) -> dict:
    with svc.sessions.begin() as session:
        if not request_id.startswith(store.REQUEST_PREFIX):
            raise store.NotFound(f"request {request_id} not found")
        try:
            batch = store.get_batch(session, request_id, me.tenant_id)
        except store.NotFound:
            raise store.NotFound(f"request {request_id} not found") from None
        return store.request_view(session, batch)
