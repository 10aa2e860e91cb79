"""Webhook endpoints, and the outbox rows that announce a batch's end to them (delivered by the webhooks queue).

`notify` notes the ids of the rows it writes in the session (`new_deliveries`), so that whoever commits the
transaction can publish their delivery messages right after; the periodic sweep (`due_deliveries`) catches the rest.
"""

from __future__ import annotations

import base64
import secrets
import time
from urllib.parse import urlsplit

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from sluice.api.store.common import REQUEST_PREFIX, InvalidInput, NotFound, new_id
from sluice.api.store.ids import findable
from sluice.api.store.listing import page
from sluice.api.tables import Tenant, WebhookDelivery, WebhookEndpoint

EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
OUTBOX_KEY = "sluice.new_deliveries"
# every event is sent to each of the tenant's endpoints that wants it: unbounded, one batch could have the webhooks
# worker send any number of requests (to any public address: an amplifier), and keep as many rows
MAX_ENDPOINTS = 16
MAX_URL_CHARS = 2048  # each is stored, and sent on every attempt


def create_webhook_endpoint(session: Session, tenant_id: int, url: str,
                            events: list[str] | None = None) -> WebhookEndpoint:
    """A new endpoint for all EVENTS unless `events` names some; its `secret` is to be shown once, by the caller."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidInput(f"url: at most {MAX_URL_CHARS} characters, not {len(url)}", "url")
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise InvalidInput(f"url {url!r}: an http:// or https:// URL is required", "url")
    events = list(EVENTS) if events is None else list(dict.fromkeys(events))  # each once, however often named
    unknown = sorted(set(events) - set(EVENTS))
    if unknown or not events:
        raise InvalidInput(f"events: {unknown or 'none given'}; choose from {', '.join(EVENTS)}", "events")
    # the tenant's row locked (FOR NO KEY UPDATE: no wait on the key-share locks of its uploads and batches' foreign
    # keys): two creations at once cannot both pass the count
    session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))
    if session.scalar(select(func.count()).select_from(WebhookEndpoint)
                      .where(WebhookEndpoint.tenant_id == tenant_id)) >= MAX_ENDPOINTS:
        raise InvalidInput(f"a tenant has at most {MAX_ENDPOINTS} webhook endpoints: delete one first", "url")
    # Standard Webhooks secrets: whsec_ and base64 of the HMAC key
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    endpoint = WebhookEndpoint(id=new_id("we_"), tenant_id=tenant_id, url=url, events=events, secret=secret,
                               created_at=time.time())
    session.add(endpoint)
    session.flush()
    return endpoint


def get_webhook_endpoint(session: Session, endpoint_id: str, tenant_id: int) -> WebhookEndpoint:
    endpoint = session.get(WebhookEndpoint, endpoint_id) if findable(endpoint_id) else None
    if endpoint is None or endpoint.tenant_id != tenant_id:
        raise NotFound(f"webhook endpoint {endpoint_id} not found")
    return endpoint


def list_webhook_endpoints(session: Session, tenant_id: int) -> list[WebhookEndpoint]:
    return list(session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
                                .order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)))


def delete_webhook_endpoint(session: Session, endpoint_id: str, tenant_id: int) -> None:
    """Delete the endpoint and its deliveries, pending ones included: nothing more is sent to it."""
    get_webhook_endpoint(session, endpoint_id, tenant_id)
    session.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id))


def list_deliveries(session: Session, endpoint_id: str, tenant_id: int, after: str | None,
                    limit: int) -> tuple[list[WebhookDelivery], bool]:
    """The endpoint's deliveries, newest first, after the delivery `after`; and whether more follow."""
    get_webhook_endpoint(session, endpoint_id, tenant_id)
    return page(session, select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id), WebhookDelivery,
                after, limit)


def due_deliveries(session: Session, now: float, overdue: float = 0.0, limit: int = 1000) -> list[str]:
    """Ids of pending deliveries due for more than `overdue` seconds (their message was lost), for the periodic sweep
    to publish. The same UPDATE stamps them due as of `now`, so that neither a concurrent sweep nor the next ones send
    them again unless they stay unattempted for `overdue` more seconds: every reconciler of every worker sweeps."""
    due = (WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now - overdue)
    oldest = select(WebhookDelivery.id).where(*due).order_by(WebhookDelivery.next_attempt_at).limit(limit)
    # `due` again on the row itself: a sweep that waited for a concurrent one's row lock re-checks it, and skips it
    return list(session.scalars(update(WebhookDelivery).where(WebhookDelivery.id.in_(oldest), *due)
                                .values(next_attempt_at=now).returning(WebhookDelivery.id)))


def new_deliveries(session: Session) -> list[str]:
    """Ids of the outbox rows `notify` wrote in this session: publish them once its transaction has committed."""
    return list(session.info.get(OUTBOX_KEY, ()))


def notify(session: Session, tenant_id: int, event_type: str, batch_id: str, now: float) -> int:
    """Write one outbox row per endpoint of the tenant that wants `event_type`, in the caller's transaction."""
    if batch_id.startswith(REQUEST_PREFIX):  # a single request is polled by its id; batch events are for batches
        return 0
    # FOR KEY SHARE: an endpoint being deleted is waited for and skipped, and a later delete waits for this
    # transaction (cascading to its rows); read plainly, its outbox row failed the foreign key once the delete
    # committed, and with it the write that ended the batch (a worker's results, a cancel, an expiry)
    endpoints = session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
                                .with_for_update(read=True, key_share=True)).all()
    wanted = [e for e in endpoints if event_type in e.events]
    event = {"id": new_id("evt_"), "object": "event", "type": event_type, "created_at": int(now),
             "data": {"id": batch_id}}
    rows = [WebhookDelivery(id=new_id("msg_"), endpoint_id=e.id, event_type=event_type, payload=event,
                            status="pending", attempts=0, next_attempt_at=now, created_at=now) for e in wanted]
    session.add_all(rows)
    session.info.setdefault(OUTBOX_KEY, []).extend(row.id for row in rows)
    return len(rows)
