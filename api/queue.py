"""The task queue's conventions (one Celery app factory for producers and workers) and publishing chunk messages.

Usable without torch: the tasks themselves live in worker/, so messages are sent by task name. Redis carries
messages, not truth: a message is a list of request ids, and a task that receives ids already finished skips them.
On Redis a lower priority number is served first (kombu pops priority 0's list before 1's); sluice's priorities
follow the same order, 0 first and 9 last, which is also the engine's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from celery import Celery

from sluice.api.env import float_setting
from sluice.api.prefix_order import pack
from sluice.api.store.batches import PRIORITIES, Work

RUN_CHUNK = "sluice.run_chunk"
DELIVER_WEBHOOK = "sluice.deliver_webhook"
RECONCILE = "sluice.reconcile"
WEBHOOKS_QUEUE = "webhooks"
MAINTENANCE_QUEUE = "maintenance"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CHUNK_SIZE = 32
# An unacked message is handed to another worker after this long, so it must exceed the longest run of a chunk
# (and any countdown a task is retried with). A killed worker's requests come back sooner, through the reconciler.
VISIBILITY_TIMEOUT = 12 * 3600


def broker_url() -> str:
    return os.environ.get("SLUICE_BROKER_URL") or DEFAULT_BROKER_URL


def chunk_size() -> int:
    """SLUICE_CHUNK_SIZE: request ids per message (default 32)."""
    raw = os.environ.get("SLUICE_CHUNK_SIZE") or str(DEFAULT_CHUNK_SIZE)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"SLUICE_CHUNK_SIZE={raw!r}: give a whole number of requests per message, at least 1")
    return int(raw)


def reconcile_seconds() -> float:
    """SLUICE_RECONCILE_SECONDS: how often celery beat schedules the reconciler (default 30)."""
    return float_setting("SLUICE_RECONCILE_SECONDS", os.environ.get("SLUICE_RECONCILE_SECONDS") or "30",
                         lambda seconds: seconds > 0, "give a positive number of seconds")


def model_queue(served_model_name: str) -> str:
    return f"model.{served_model_name}"


def queue_depth(app: Celery, queue: str) -> int:
    """Messages waiting in a queue, all priorities (Redis keeps one list per priority); messages being run are not
    counted. Asked through kombu, so it works on any transport (Redis, or memory:// in `sluice serve`)."""
    with app.connection_for_read() as connection:
        return connection.default_channel.queue_declare(queue=queue, passive=False).message_count


def make_app(broker: str | None = None) -> Celery:
    app = Celery("sluice", broker=broker or broker_url(), set_as_current=False)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json",
        task_ignore_result=True,  # results go to the database
        task_acks_late=True,  # ack after the results are committed, so a killed worker's message comes back
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a worker holds only the messages it is running
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker waits out a Redis outage however long (Celery: 100 tries)
        task_routes={DELIVER_WEBHOOK: {"queue": WEBHOOKS_QUEUE}, RECONCILE: {"queue": MAINTENANCE_QUEUE}},
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "priority_steps": list(PRIORITIES),  # one Redis list per priority, so every level is exact
            "sep": ":",  # priority 3 of queue model.x is the list "model.x:3"
            "queue_order_strategy": "priority",  # a worker of several queues drains them in the order given
        },
    )
    return app


def publish_chunks(app: Celery, work: Iterable[Work], size: int | None = None) -> int:
    """Send each Work's request ids in messages of `size` (default SLUICE_CHUNK_SIZE) to its model's queue at its
    priority, lines sharing a prompt prefix in one message where they fit; returns the number of messages sent."""
    size = size or chunk_size()
    sent = 0
    with app.producer_or_acquire() as producer:
        for w in work:
            chunks = pack(w.groups, size) if w.groups is not None else [
                w.request_ids[start:start + size] for start in range(0, len(w.request_ids), size)]
            for chunk in chunks:
                app.send_task(RUN_CHUNK, args=[chunk], queue=model_queue(w.model), priority=w.priority,
                              producer=producer)
                sent += 1
    return sent
