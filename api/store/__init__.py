"""The store: every transactional operation on sluice's database, each a short function taking a Session.

Functions run inside the caller's transaction and never commit, so that a caller can combine them and decides when
the work becomes visible: `with sessions.begin() as session: ...` (see api.db). Work they return (chunks to publish)
is for after the commit. Refusals raise StoreError subclasses whose message names the problem; nothing is stored.
"""

from api.store.batches import DEFAULT_PRIORITY, MAX_LINES, Work, create_batch
from api.store.common import InvalidInput, NotFound, StoreError
from api.store.files import MAX_FILE_BYTES, file_content, get_file, store_file
from api.store.leases import Claimed, RequestResult, claim, mark_cancelled, release, renew_leases, write_results
from api.store.lifecycle import cancel_batch, expire_batches
from api.store.recovery import models_with_queued_requests, recover_expired_leases, republish_stale
from api.store.tenants import DEFAULT_TENANT, create_api_key, get_or_create_tenant, resolve_api_key, revoke_api_key
from api.store.usage import DayUsage, batch_usage, cost, gpu_hour_cost, tenant_usage
from api.store.views import (
    batch_view,
    error_file_id,
    error_lines,
    get_batch,
    output_file_id,
    output_lines,
    view_file,
)
from api.store.webhooks import EVENTS, create_webhook_endpoint
from api.store.workers import efficiency_windows, heartbeat, live_workers, record_efficiency

__all__ = [
    "DEFAULT_PRIORITY", "DEFAULT_TENANT", "EVENTS", "MAX_FILE_BYTES", "MAX_LINES", "Claimed", "DayUsage",
    "InvalidInput", "NotFound", "RequestResult", "StoreError", "Work", "batch_usage", "batch_view", "cancel_batch",
    "claim", "cost", "create_api_key", "create_batch", "create_webhook_endpoint", "efficiency_windows",
    "error_file_id", "error_lines", "expire_batches", "file_content", "get_batch", "get_file", "get_or_create_tenant",
    "gpu_hour_cost", "heartbeat", "live_workers", "mark_cancelled", "models_with_queued_requests", "output_file_id",
    "output_lines",
    "record_efficiency", "recover_expired_leases", "release", "renew_leases", "republish_stale", "resolve_api_key",
    "revoke_api_key", "store_file", "tenant_usage", "view_file", "write_results",
]
