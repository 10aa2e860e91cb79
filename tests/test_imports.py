"""The dependency rule, checked: API hosts and the CPU worker never load the GPU stack."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("modules", [
    "api.schemas, api.store, api.server, api.client, api.webhooks, api.queue",  # an API host
    "worker.celery_app, worker.tasks, worker.reconcile",  # the webhooks and maintenance worker
    "worker.cli",  # `sluice --help`
])
def test_no_torch(modules):
    code = f"import sys, {modules}; from worker.cli import build_parser; build_parser(); " \
           "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    subprocess.run([sys.executable, "-c", code], check=True)
