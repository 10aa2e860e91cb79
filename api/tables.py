"""The tables: tenants and keys, files, batches, requests and their results, workers, efficiency and webhooks.

Times are unix seconds in float columns, the same on PostgreSQL and SQLite and directly comparable with time.time().
String ids carry OpenAI's prefixes (file-, batch_, msg_); requests use integer ids, because chunk messages carry
them by the thousand. A batch's request_counts are counter columns, changed only in the transaction that changes the
requests they count, so they are exact at every moment.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite gives autoincrement only to a column declared INTEGER PRIMARY KEY
BigId = BigInteger().with_variant(Integer(), "sqlite")


# names for every constraint, so that later migrations can drop them by name (SQLite's batch mode needs that)
NAMING = {"ix": "ix_%(column_0_N_label)s", "uq": "uq_%(table_name)s_%(column_0_N_name)s",
          "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s", "pk": "pk_%(table_name)s"}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    # none_as_null: a Python None is SQL NULL, not the JSON value null, so that `IS NULL` finds it
    type_annotation_map = {float: Double(), dict[str, Any]: JSON(none_as_null=True),
                           list[Any]: JSON(none_as_null=True)}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float]


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # key_...
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    prefix: Mapped[str] = mapped_column(String(16))  # the key's first characters, to tell keys apart in lists
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # file-...
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))  # processed: the content is stored
    created_at: Mapped[float]


class DeletedFile(Base):
    """A deleted file's place in its tenant's file list: a client deleting the files it pages through (the openai
    SDK's auto-paging does) names the last one it deleted as the next page's `after`."""

    __tablename__ = "deleted_files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # file-...
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    created_at: Mapped[float]  # the file's


class FileContent(Base):
    """Kept apart from `files` so that listing files never reads their bytes; several API hosts share it."""

    __tablename__ = "file_contents"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant_created", "tenant_id", "created_at"),
                      Index("ix_batches_status_expires", "status", "expires_at"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # batch_...
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    # no foreign key: as in OpenAI, a batch keeps naming its input file after the file is deleted
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(255))  # the served model name, which names the queue
    priority: Mapped[int]  # 0 runs first, 9 last
    status: Mapped[str] = mapped_column(String(16))
    errors: Mapped[list[Any] | None]  # why the whole file was refused: [{code, message, param, line}]
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata")
    request_total: Mapped[int]
    request_completed: Mapped[int]
    request_failed: Mapped[int]
    # the sums of its results' usage, kept as they are written (store.write_results), so that reading a batch does
    # not sum its results: 0.1 s a read for 50,000 of them, on every status poll and every batch of a list page
    usage_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    usage_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    usage_completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    usage_gpu_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    usage_cost: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # the byte sizes of its output and error files, kept by the first metadata read once the batch has ended (its
    # results never change after that), so that later reads do not render the whole file: 2-3 s of API CPU for 44,000
    # lines (api.store.views.keep_file_bytes); null until then. A change to the files' line format must null them
    output_bytes: Mapped[int | None] = mapped_column(BigInteger)
    error_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # the distinct system_fingerprints of its results, sorted, added as they are written (store.write_results), so
    # that reading a batch does not read its results; null until the first response
    system_fingerprints: Mapped[list[Any] | None]
    created_at: Mapped[float]
    in_progress_at: Mapped[float | None]
    expires_at: Mapped[float]
    finalizing_at: Mapped[float | None]
    completed_at: Mapped[float | None]
    failed_at: Mapped[float | None]
    expired_at: Mapped[float | None]
    cancelling_at: Mapped[float | None]
    cancelled_at: Mapped[float | None]


def _where_status(name: str, column: str, status: str) -> Index:
    """An index of `column` over the requests of one status (a literal there: queries name it likewise)."""
    where = text(f"status = '{status}'")
    return Index(name, column, postgresql_where=where, sqlite_where=where)


class Request(Base):
    """One input line. An invalid line is a failed request with a result holding its error and no body."""

    __tablename__ = "requests"
    __table_args__ = (UniqueConstraint("batch_id", "custom_id"),
                      UniqueConstraint("batch_id", "line"),  # also the order of output files
                      # the reconciler's and the gauges' lookups, over the rows they look for only: a request is
                      # in neither once it has finished, so its finishing update (like the insert of a finished,
                      # invalid line) writes no entry in them, and they stay the size of the work in flight
                      _where_status("ix_requests_running_lease", "lease_expires_at", "running"),
                      _where_status("ix_requests_queued_published", "published_at", "queued"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int]
    custom_id: Mapped[str | None] = mapped_column(Text)  # null on invalid lines: their error keeps what was given
    url: Mapped[str | None] = mapped_column(String(64))
    body: Mapped[dict[str, Any] | None]  # the validated body, as api.batch_lines dumps it
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int]
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[float | None]
    published_at: Mapped[float | None]  # when its last message was sent
    created_at: Mapped[float]


class Result(Base):
    """How a request ended: a response body, or an error {code, message, param} (plus custom_id for bad lines).

    batch_id and line repeat its request's, so that a batch's results page in finishing order (api.store.views
    .result_page) reads ix_results_batch_finished_line from its cursor on, instead of sorting all the batch's results
    for every page; no foreign key: the request's already ties the row to its batch."""

    __tablename__ = "results"
    __table_args__ = (Index("ix_results_batch_finished_line", "batch_id", "finished_at", "line"),)

    request_id: Mapped[int] = mapped_column(BigId, ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(40))
    line: Mapped[int]
    status_code: Mapped[int]
    response: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    prompt_tokens: Mapped[int]
    cached_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    queue_seconds: Mapped[float | None]
    ttft_seconds: Mapped[float | None]
    e2e_seconds: Mapped[float | None]
    gpu_seconds: Mapped[float]
    cost: Mapped[float]
    worker_id: Mapped[str | None] = mapped_column(String(255))
    finished_at: Mapped[float] = mapped_column(index=True)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    model: Mapped[str] = mapped_column(Text)  # the checkpoint it loaded
    served_model_name: Mapped[str] = mapped_column(String(255), index=True)  # names its queue
    # a LoRA adapter's row: the served name of the base model it runs on (`model` is then the adapter's directory)
    parent: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))  # starting, running, stopping, stopped
    started_at: Mapped[float]
    last_heartbeat_at: Mapped[float]


class EfficiencyWindow(Base):
    """A worker's engine over a time window: how full its batches were and where the time went."""

    __tablename__ = "efficiency_windows"
    __table_args__ = (Index("ix_efficiency_model_start", "model", "window_start"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(255))  # served model name
    window_start: Mapped[float]
    window_end: Mapped[float]
    steps: Mapped[int]
    prefill_tokens: Mapped[int]
    decode_tokens: Mapped[int]
    mean_running_seqs: Mapped[float]
    max_running_seqs: Mapped[int]
    max_num_seqs: Mapped[int]
    token_budget_use: Mapped[float]  # mean scheduled tokens / max_num_batched_tokens
    kv_cache_use: Mapped[float]  # mean used blocks / all blocks
    preemptions: Mapped[int]
    prefix_cache_queries: Mapped[int]  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: Mapped[int]  # of which found
    busy_seconds: Mapped[float]
    idle_seconds: Mapped[float]


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # we_...
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[Any]]  # event types it receives
    secret: Mapped[str] = mapped_column(String(64))  # whsec_...: kept in the clear, signing needs it
    created_at: Mapped[float]


class WebhookDelivery(Base):
    """The outbox: one row per event and endpoint, written in the transaction that caused the event."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # msg_..., the webhook-id of every attempt
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    event_type: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))  # pending, delivered, failed
    attempts: Mapped[int]
    next_attempt_at: Mapped[float]
    last_status_code: Mapped[int | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float]
    delivered_at: Mapped[float | None]
