"""/v1/webhook_endpoints: register, list, retrieve and delete the URLs told of a batch's end; read deliveries.

An endpoint's secret (whsec_...) is shown once, at creation; events are signed with it per Standard Webhooks, so
`openai.OpenAI(webhook_secret=...).webhooks.unwrap(body, headers)` verifies them. Deliveries that keep failing
stay listed with their last status code and error.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from sluice.api import store
from sluice.api.auth import CallerDep, hold_key
from sluice.api.deps import ServicesDep
from sluice.api.errors import ApiError
from sluice.api.rest_objects import (
    WebhookDeliveryList,
    WebhookDeliveryObject,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
)
from sluice.api.tables import WebhookDelivery, WebhookEndpoint
from sluice.api.webhooks import UrlRefused, check_url

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"])


class WebhookEndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    events: list[str] | None = None


@router.post("", response_model=WebhookEndpointWithSecret, summary="Register a webhook endpoint")
def create_endpoint(body: WebhookEndpointCreate, svc: ServicesDep, me: CallerDep) -> WebhookEndpointWithSecret:
    try:
        check_url(body.url)
    except UrlRefused as e:
        raise ApiError(400, str(e), "url", "url_not_allowed") from None
    with svc.sessions.begin() as session:
        hold_key(session, me)
        endpoint = store.create_webhook_endpoint(session, me.tenant_id, body.url, body.events)
        return WebhookEndpointWithSecret(**_endpoint(endpoint).model_dump(), secret=endpoint.secret)


@router.get("", response_model=WebhookEndpointList, summary="List webhook endpoints")
def list_endpoints(svc: ServicesDep, me: CallerDep) -> WebhookEndpointList:
    with svc.sessions.begin() as session:
        return WebhookEndpointList(data=[_endpoint(e) for e in store.list_webhook_endpoints(session, me.tenant_id)])


@router.get("/{endpoint_id}", response_model=WebhookEndpointObject, summary="Retrieve a webhook endpoint")
def get_endpoint(svc: ServicesDep, me: CallerDep, endpoint_id: str) -> WebhookEndpointObject:
    with svc.sessions.begin() as session:
        return _endpoint(store.get_webhook_endpoint(session, endpoint_id, me.tenant_id))


@router.delete("/{endpoint_id}", response_model=WebhookEndpointDeleted, summary="Delete a webhook endpoint")
def delete_endpoint(svc: ServicesDep, me: CallerDep, endpoint_id: str) -> WebhookEndpointDeleted:
    with svc.sessions.begin() as session:
        store.delete_webhook_endpoint(session, endpoint_id, me.tenant_id)
    return WebhookEndpointDeleted(id=endpoint_id, deleted=True)


@router.get("/{endpoint_id}/deliveries", response_model=WebhookDeliveryList,
            summary="sluice: an endpoint's deliveries, newest first")
def list_deliveries(svc: ServicesDep, me: CallerDep, endpoint_id: str, after: str | None = None,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20) -> WebhookDeliveryList:
    with svc.sessions.begin() as session:
        rows, has_more = store.list_deliveries(session, endpoint_id, me.tenant_id, after, limit)
        data = [_delivery(row) for row in rows]
    return WebhookDeliveryList(data=data, first_id=data[0].id if data else None,
                               last_id=data[-1].id if data else None, has_more=has_more)


def _endpoint(e: WebhookEndpoint) -> WebhookEndpointObject:
    return WebhookEndpointObject(id=e.id, url=e.url, events=e.events, created_at=int(e.created_at))


def _delivery(d: WebhookDelivery) -> WebhookDeliveryObject:
    return WebhookDeliveryObject(id=d.id, event_type=d.event_type, payload=d.payload, status=d.status,
                                 attempts=d.attempts,
                                 next_attempt_at=int(d.next_attempt_at) if d.status == "pending" else None,
                                 last_status_code=d.last_status_code, last_error=d.last_error,
                                 created_at=int(d.created_at),
                                 delivered_at=None if d.delivered_at is None else int(d.delivered_at))
