"""The Celery app workers run: api.queue's conventions, sluice's tasks, and the periodic reconciler.

`celery -A worker.celery_app worker -Q webhooks,maintenance` is the CPU worker (webhooks and reconciliation);
`sluice worker --model DIR` starts a GPU worker on its model's queue. Importing this never imports torch.
"""

from __future__ import annotations

import os

from api.queue import RECONCILE, make_app

RECONCILE_SECONDS = float(os.environ.get("SLUICE_RECONCILE_SECONDS") or 30)

app = make_app()
app.conf.include = ["worker.tasks"]
app.conf.beat_schedule = {"reconcile": {"task": RECONCILE, "schedule": RECONCILE_SECONDS}}
