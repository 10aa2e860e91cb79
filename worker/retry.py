"""Transient database errors (a restart or failover dropped the connection, a deadlock victim) are retried with
backoff on a fresh connection; anything else is raised at once. Torch-free: the CPU worker's reconciler uses it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

log = logging.getLogger(__name__)
DB_ATTEMPTS = 5
T = TypeVar("T")


def retry_transient(work: Callable[[], T], attempts: int = DB_ATTEMPTS) -> T:
    """Run `work` (one whole transaction: it must be safe to run again after a rollback)."""
    for attempt in range(attempts):
        try:
            return work()
        except DBAPIError as e:
            if attempt == attempts - 1 or not (e.connection_invalidated or transient(e)):
                raise
            log.warning("database error, retrying: %s", e.orig)
            time.sleep(0.2 * 2 ** attempt)
    raise AssertionError("unreachable")


def transient(e: DBAPIError) -> bool:
    return isinstance(e, OperationalError) or "deadlock" in str(e.orig).lower()
