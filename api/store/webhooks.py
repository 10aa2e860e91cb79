"""Webhook endpoints, and the outbox rows that announce a batch's end to them (delivered by the webhooks queue)."""

from __future__ import annotations

import base64
import secrets
import time
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import WebhookDelivery, WebhookEndpoint
from api.store.common import InvalidInput, new_id

EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")


def create_webhook_endpoint(session: Session, tenant_id: int, url: str,
                            events: list[str] | None = None) -> WebhookEndpoint:
    """A new endpoint for all EVENTS unless `events` names some; its `secret` is to be shown once, by the caller."""
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise InvalidInput(f"url {url!r}: an http:// or https:// URL is required", "url")
    events = list(EVENTS) if events is None else events
    unknown = sorted(set(events) - set(EVENTS))
    if unknown or not events:
        raise InvalidInput(f"events: {unknown or 'none given'}; choose from {', '.join(EVENTS)}", "events")
    # Standard Webhooks secrets: whsec_ and base64 of the HMAC key
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    endpoint = WebhookEndpoint(id=new_id("we_"), tenant_id=tenant_id, url=url, events=events, secret=secret,
                               created_at=time.time())
    session.add(endpoint)
    session.flush()
    return endpoint


def notify(session: Session, tenant_id: int, event_type: str, batch_id: str, now: float) -> int:
    """Write one outbox row per endpoint of the tenant that wants `event_type`, in the caller's transaction."""
    endpoints = session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)).all()
    wanted = [e for e in endpoints if event_type in e.events]
    event = {"id": new_id("evt_"), "object": "event", "type": event_type, "created_at": int(now),
             "data": {"id": batch_id}}
    session.add_all(WebhookDelivery(id=new_id("msg_"), endpoint_id=e.id, event_type=event_type, payload=event,
                                    status="pending", attempts=0, next_attempt_at=now, created_at=now)
                    for e in wanted)
    return len(wanted)
