"""A GPU worker's maintenance thread: lease renewals, heartbeats, efficiency windows and the reconciliation timer."""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from sluice.api import store
from sluice.worker.efficiency import EfficiencyWindow
from sluice.worker.reconcile import reconcile_once

if TYPE_CHECKING:
    from sluice.worker.gpu_worker import GpuWorker

log = logging.getLogger(__name__)
RENEW_SECONDS = 5.0  # renewing leases also tells the worker what to abort (cancelled batches): a cancel acts this fast


class Maintenance:
    """What a GPU worker does on timers, on a thread of its own beside its chunks; the worker owns one."""

    def __init__(self, worker: GpuWorker):
        self.worker = worker
        self.windows: queue.Queue[EfficiencyWindow] = queue.Queue()  # closed by the engine, not yet stored
        self._closed = threading.Event()
        self._beat_lock = threading.Lock()  # one beat at a time, each writing the status as it is when it writes
        self._thread = threading.Thread(target=self._run, name="maintenance", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread once its pass is over, then store the windows still waiting."""
        self._closed.set()
        self._thread.join(timeout=30)
        self.flush_windows()

    def _run(self) -> None:
        worker, settings = self.worker, self.worker.settings
        due = {"lease": 0.0, "beat": 0.0, "reconcile": 0.0}
        while not self._closed.wait(0.5):
            now = time.monotonic()
            try:
                if now >= due["lease"]:
                    due["lease"] = now + min(settings.lease_seconds / 3, RENEW_SECONDS)
                    self.renew_leases()
                if now >= due["beat"]:
                    due["beat"] = now + settings.heartbeat_seconds
                    self.flush_windows()
                    self.heartbeat()
                if now >= due["reconcile"] and not worker.stopping.is_set():
                    due["reconcile"] = now + settings.reconcile_seconds
                    reconcile_once(worker.sessions, worker.app, settings.stale_seconds)
            except Exception:  # the database or broker may be down for a while; keep going
                log.exception("maintenance pass failed; retrying")
            if worker.bridge.error is not None:
                log.error("the engine thread died: %r", worker.bridge.error)
                os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown
                return

    def renew_leases(self) -> None:
        """Extend the leases of the requests in flight; abort in the engine those the store no longer lets us run."""
        worker = self.worker
        ids = worker.in_flight_ids()
        if ids:
            for request_id in worker.db(lambda s: store.renew_leases(s, ids, worker.id,
                                                                     worker.settings.lease_seconds)):
                worker.bridge.abort(str(request_id))

    def flush_windows(self) -> None:
        worker, rows = self.worker, []
        while not self.windows.empty():
            rows.append(self.windows.get_nowait().to_row(worker.id, worker.settings.served_model_name))
        if rows:
            worker.db(lambda s: [store.record_efficiency(s, row) for row in rows])

    def heartbeat(self, status: str | None = None) -> None:
        """Record the worker's status (default: its `status()`, read under the lock, so a beat of this thread that
        read "starting" cannot commit after mark_consuming's "running" and leave the worker not live)."""
        worker, settings = self.worker, self.worker.settings
        with self._beat_lock:
            current = status or worker.status()
            worker.db(lambda s: store.heartbeat(s, worker.id, hostname=socket.gethostname(), pid=os.getpid(),
                                                model=settings.model, served_model_name=settings.served_model_name,
                                                status=current, adapters=settings.adapters))
