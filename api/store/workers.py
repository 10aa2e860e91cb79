"""Workers: heartbeats (who serves which model, since when), liveness, and their engine efficiency windows.

A worker serving LoRA adapters beside its base model beats one row for the base (its id) and one per adapter (its id
with a suffix, `parent` naming the base): every query that asks who serves a name finds adapters as it finds models.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.api.store.common import insert
from sluice.api.tables import EfficiencyWindow, Worker

LIVE_SECONDS = 60.0  # a worker that has not beaten for this long counts as gone
# starting: the engine is built but the worker does not consume its queue yet (not live: nothing would run)
STATUSES = ("starting", "running", "stopping", "stopped")


def heartbeat(session: Session, worker_id: str, *, hostname: str, pid: int, model: str, served_model_name: str,
              status: str = "running", adapters: Mapping[str, str] | None = None) -> None:
    """Insert the worker on its first beat, refresh it after; `status`: starting, running, stopping or stopped.
    `adapters`: the LoRA adapters it serves beside the base model, served name -> directory."""
    if status not in STATUSES:
        raise ValueError(f"worker status {status!r}: one of {', '.join(STATUSES)}")
    now = time.time()
    rows = [dict(id=worker_id, model=model, served_model_name=served_model_name, parent=None)]
    # numbered rather than named: an adapter's name may be as long as the id column
    rows += [dict(id=f"{worker_id}+lora{i}", model=path, served_model_name=name, parent=served_model_name)
             for i, (name, path) in enumerate(sorted((adapters or {}).items()), 1)]
    for row in rows:
        stmt = insert(session, Worker).values(**row, hostname=hostname, pid=pid, status=status, started_at=now,
                                              last_heartbeat_at=now)
        session.execute(stmt.on_conflict_do_update(index_elements=["id"],
                                                   set_={"status": status, "last_heartbeat_at": now}))


def live_workers(session: Session, served_model_name: str | None = None) -> list[Worker]:
    """Running workers heard from in the last LIVE_SECONDS, of one model or all."""
    stmt = select(Worker).where(Worker.status == "running", Worker.last_heartbeat_at > time.time() - LIVE_SECONDS)
    if served_model_name is not None:
        stmt = stmt.where(Worker.served_model_name == served_model_name)
    return list(session.scalars(stmt.order_by(Worker.id)))


def adapter_parents(session: Session) -> dict[str, str]:
    """Live workers' LoRA adapters: served name -> the served name of the base model it runs on."""
    return {w.served_model_name: w.parent for w in live_workers(session) if w.parent is not None}


def record_efficiency(session: Session, window: EfficiencyWindow) -> None:
    session.add(window)


def efficiency_windows(session: Session, model: str, start: float, end: float) -> list[EfficiencyWindow]:
    """The windows of a served model's workers that overlap [start, end], in time order."""
    return list(session.scalars(select(EfficiencyWindow)
                                .where(EfficiencyWindow.model == model, EfficiencyWindow.window_start <= end,
                                       EfficiencyWindow.window_end >= start)
                                .order_by(EfficiencyWindow.window_start, EfficiencyWindow.id)))

