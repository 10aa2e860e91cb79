"""The store: every transactional operation on sluice's database, each a short function taking a Session.

Functions run inside the caller's transaction and never commit, so that a caller can combine them and decides when
the work becomes visible: `with sessions.begin() as session: ...` (see api.db). Work they return (chunks to publish)
is for after the commit. Refusals raise StoreError subclasses whose message names the problem; nothing is stored.
"""

from sluice.api.store.batches import (
    DEFAULT_PRIORITY,
    MAX_LINES,
    Work,
    create_batch,
    create_request,
    input_file_problem,
    submit_jsonl,
)
from sluice.api.store.common import REQUEST_PREFIX, Conflict, InvalidInput, NotFound, StoreError
from sluice.api.store.files import MAX_FILE_BYTES, file_content, file_slice, get_file, store_file
from sluice.api.store.leases import Claimed, RequestResult, claim, mark_cancelled, release, renew_leases, write_results
from sluice.api.store.lifecycle import cancel_batch, expire_batches
from sluice.api.store.listing import delete_file, list_batches, list_files
from sluice.api.store.metrics import kv_cache_use, latency_histogram, requests_by_status, token_totals
from sluice.api.store.recovery import models_with_waiting_requests, recover_expired_leases, republish_stale
from sluice.api.store.tenants import (
    DEFAULT_TENANT,
    create_api_key,
    find_api_key,
    get_or_create_tenant,
    hold_live_key,
    resolve_api_key,
    revoke_api_key,
)
from sluice.api.store.usage import DayUsage, batch_usage, cost, gpu_hour_cost, tenant_usage
from sluice.api.store.views import (
    batch_view,
    error_file_id,
    error_lines,
    file_page,
    get_batch,
    output_file_id,
    output_lines,
    owned_view,
    request_view,
    result_page,
    view_file,
)
from sluice.api.store.webhooks import (
    EVENTS,
    create_webhook_endpoint,
    delete_webhook_endpoint,
    due_deliveries,
    get_webhook_endpoint,
    list_deliveries,
    list_webhook_endpoints,
    new_deliveries,
)
from sluice.api.store.workers import adapter_parents, efficiency_windows, heartbeat, live_workers, record_efficiency

__all__ = [
    "Claimed", "Conflict", "DEFAULT_PRIORITY", "DEFAULT_TENANT", "DayUsage", "EVENTS", "InvalidInput",
    "MAX_FILE_BYTES", "MAX_LINES", "NotFound", "REQUEST_PREFIX", "RequestResult", "StoreError", "Work",
    "adapter_parents", "batch_usage", "batch_view", "cancel_batch", "claim", "cost", "create_api_key", "create_batch",
    "create_request", "create_webhook_endpoint", "delete_file", "delete_webhook_endpoint", "due_deliveries",
    "efficiency_windows", "error_file_id", "error_lines", "expire_batches", "file_content", "file_page",
    "file_slice", "find_api_key", "get_batch", "get_file", "get_or_create_tenant", "get_webhook_endpoint",
    "gpu_hour_cost", "heartbeat", "hold_live_key", "input_file_problem", "kv_cache_use", "latency_histogram",
    "list_batches", "list_deliveries", "list_files", "list_webhook_endpoints", "live_workers", "mark_cancelled",
    "models_with_waiting_requests", "new_deliveries", "output_file_id", "output_lines", "owned_view",
    "record_efficiency", "recover_expired_leases", "release", "renew_leases", "republish_stale", "request_view",
    "requests_by_status", "resolve_api_key", "result_page", "revoke_api_key", "store_file", "submit_jsonl",
    "tenant_usage", "token_totals", "view_file", "write_results",
]
