"""Sending what a committed transaction leaves to send: chunk messages and webhook delivery messages.

The rows are the truth and are already stored, so a broker that is down fails nothing: it is logged, and the
reconciler re-sends queued requests and the delivery sweep re-sends due deliveries.
"""

from __future__ import annotations

import logging

from celery import Celery
from kombu.exceptions import OperationalError

from sluice.api.queue import publish_chunks
from sluice.api.store import Work
from sluice.api.webhooks import publish_deliveries

log = logging.getLogger(__name__)


def dispatch(app: Celery, work: list[Work], delivery_ids: list[str]) -> int:
    """Returns the number of chunk messages sent (0 when the broker refused them)."""
    try:
        sent = publish_chunks(app, work) if work else 0
        if delivery_ids:
            publish_deliveries(app, delivery_ids)
    except OperationalError as e:
        log.warning("the broker refused messages (%s); they will be re-sent by the reconciler and delivery sweep", e)
        return 0
    return sent
