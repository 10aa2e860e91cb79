"""initial schema: tenants, files, batches, requests, results, workers, efficiency, webhooks

Revision ID: 0001
Revises:
Create Date: 2026-12-02 14:47:36.260865
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("served_model_name", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("last_heartbeat_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_served_model_name"), "workers", ["served_model_name"], unique=False)
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("errors", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("metadata", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("request_total", sa.Integer(), nullable=False),
        sa.Column("request_completed", sa.Integer(), nullable=False),
        sa.Column("request_failed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("in_progress_at", sa.Double(), nullable=True),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("finalizing_at", sa.Double(), nullable=True),
        sa.Column("completed_at", sa.Double(), nullable=True),
        sa.Column("failed_at", sa.Double(), nullable=True),
        sa.Column("expired_at", sa.Double(), nullable=True),
        sa.Column("cancelling_at", sa.Double(), nullable=True),
        sa.Column("cancelled_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_status_expires", "batches", ["status", "expires_at"], unique=False)
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"], unique=False)
    op.create_table(
        "efficiency_windows",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("worker_id", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("window_start", sa.Double(), nullable=False),
        sa.Column("window_end", sa.Double(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("decode_tokens", sa.Integer(), nullable=False),
        sa.Column("mean_running_seqs", sa.Double(), nullable=False),
        sa.Column("max_running_seqs", sa.Integer(), nullable=False),
        sa.Column("max_num_seqs", sa.Integer(), nullable=False),
        sa.Column("token_budget_use", sa.Double(), nullable=False),
        sa.Column("kv_cache_use", sa.Double(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("prefix_cache_queries", sa.Integer(), nullable=False),
        sa.Column("prefix_cache_hits", sa.Integer(), nullable=False),
        sa.Column("busy_seconds", sa.Double(), nullable=False),
        sa.Column("idle_seconds", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_efficiency_windows_worker_id_workers"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_efficiency_windows")),
    )
    op.create_index("ix_efficiency_model_start", "efficiency_windows", ["model", "window_start"], unique=False)
    op.create_index(op.f("ix_efficiency_windows_worker_id"), "efficiency_windows", ["worker_id"], unique=False)
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_files_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"], unique=False)
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("secret", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_webhook_endpoints_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_endpoints")),
    )
    op.create_index(op.f("ix_webhook_endpoints_tenant_id"), "webhook_endpoints", ["tenant_id"], unique=False)
    op.create_table(
        "file_contents",
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name=op.f("fk_file_contents_file_id_files"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("file_id", name=op.f("pk_file_contents")),
    )
    op.create_table(
        "requests",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=True),
        sa.Column("url", sa.String(length=64), nullable=True),
        sa.Column("body", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", sa.Double(), nullable=True),
        sa.Column("published_at", sa.Double(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_requests_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_requests_batch_id_custom_id")),
        sa.UniqueConstraint("batch_id", "line", name=op.f("uq_requests_batch_id_line")),
    )
    op.create_index("ix_requests_status_lease", "requests", ["status", "lease_expires_at"], unique=False)
    op.create_index("ix_requests_status_published", "requests", ["status", "published_at"], unique=False)
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("event_type", sa.String(length=32), nullable=False),
        sa.Column("payload", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Double(), nullable=False),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("delivered_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhook_endpoints.id"],
            name=op.f("fk_webhook_deliveries_endpoint_id_webhook_endpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"], unique=False)
    op.create_index(op.f("ix_webhook_deliveries_endpoint_id"), "webhook_deliveries", ["endpoint_id"], unique=False)
    op.create_table(
        "results",
        sa.Column("request_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("response", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("queue_seconds", sa.Double(), nullable=True),
        sa.Column("ttft_seconds", sa.Double(), nullable=True),
        sa.Column("e2e_seconds", sa.Double(), nullable=True),
        sa.Column("gpu_seconds", sa.Double(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"], ["requests.id"], name=op.f("fk_results_request_id_requests"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_results")),
    )
    op.create_index(op.f("ix_results_finished_at"), "results", ["finished_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_results_finished_at"), table_name="results")
    op.drop_table("results")
    op.drop_index(op.f("ix_webhook_deliveries_endpoint_id"), table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_requests_status_published", table_name="requests")
    op.drop_index("ix_requests_status_lease", table_name="requests")
    op.drop_table("requests")
    op.drop_table("file_contents")
    op.drop_index(op.f("ix_webhook_endpoints_tenant_id"), table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
    op.drop_index("ix_files_tenant_created", table_name="files")
    op.drop_table("files")
    op.drop_index(op.f("ix_efficiency_windows_worker_id"), table_name="efficiency_windows")
    op.drop_index("ix_efficiency_model_start", table_name="efficiency_windows")
    op.drop_table("efficiency_windows")
    op.drop_index("ix_batches_tenant_created", table_name="batches")
    op.drop_index("ix_batches_status_expires", table_name="batches")
    op.drop_table("batches")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index(op.f("ix_workers_served_model_name"), table_name="workers")
    op.drop_table("workers")
    op.drop_table("tenants")
