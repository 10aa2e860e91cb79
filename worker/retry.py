"""Transient database errors (a restart or failover dropped the connection, a deadlock victim) are retried with
backoff on a fresh connection; anything else is raised at once. Torch-free: the CPU worker's reconciler uses it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

log = logging.getLogger(__name__)
# How long a transaction keeps being tried: a Postgres restart or failover takes seconds to tens of seconds, and a
# chunk whose result write gives up sooner throws its results away, and its requests run again (another attempt)
RETRY_SECONDS = 30.0
FIRST_DELAY, MAX_DELAY = 0.2, 5.0
T = TypeVar("T")


def retry_transient(work: Callable[[], T], seconds: float = RETRY_SECONDS) -> T:
    """Run `work` (one whole transaction: it must be safe to run again after a rollback), retrying transient errors
    with exponential backoff for up to `seconds`."""
    deadline = time.monotonic() + seconds
    delay = FIRST_DELAY
    while True:
        try:
            return work()
        except DBAPIError as e:
            if not (e.connection_invalidated or transient(e)) or time.monotonic() + delay > deadline:
                raise
            log.warning("database error, retrying in %.1f s: %s", delay, e.orig)
            time.sleep(delay)
            delay = min(2 * delay, MAX_DELAY)


def transient(e: DBAPIError) -> bool:
    return isinstance(e, OperationalError) or "deadlock" in str(e.orig).lower()
