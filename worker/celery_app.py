"""The Celery app workers run: api.queue's conventions, sluice's tasks, and the periodic reconciler.

`celery -A worker.celery_app worker -Q webhooks,maintenance` is the CPU worker (webhooks and reconciliation);
`sluice worker --model DIR` starts a GPU worker on its model's queue. Importing this never imports torch.
"""

from __future__ import annotations

from sluice.api.queue import RECONCILE, make_app, reconcile_seconds

RECONCILE_SECONDS = reconcile_seconds()  # read at import: beat takes its schedule from the app

app = make_app()
app.conf.include = ["sluice.worker.tasks"]
app.conf.beat_schedule = {"reconcile": {"task": RECONCILE, "schedule": RECONCILE_SECONDS}}
