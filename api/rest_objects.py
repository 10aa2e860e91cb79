"""The JSON objects the REST API answers with, as pydantic models: what /openapi.json describes is what is sent.

Field names and meanings follow OpenAI's File, Batch and list objects; sluice's additions are marked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str = Field(description="batch for uploads; batch_output for a batch's output and error files")
    status: str
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchError(BaseModel):
    code: str | None
    message: str | None
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    gpu_seconds: float = Field(description="sluice: GPU time spent on the batch's requests")
    cost: float = Field(description="sluice: gpu_seconds priced at SLUICE_GPU_HOUR_COST")


BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = Field(description="the model of its requests; null when no line named one validly")
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage
    waiting_for_worker: bool = Field(description="sluice: requests are queued for a model no live worker serves")
    system_fingerprints: list[str] = Field(description="sluice: the distinct system_fingerprint of its responses "
                                                      "so far, sorted; several where differently configured workers "
                                                      "ran it")


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResultLine(BaseModel):
    """A line of the batch's output or error file, with the input line it answers and when it finished."""

    id: str
    custom_id: str | None
    response: dict[str, Any] | None
    error: dict[str, Any] | None
    line: int
    finished_at: float


class ResultPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[ResultLine]
    has_more: bool
    last_line: int | None = Field(description="pass as `after` to get the results that finish later")


class RequestError(BaseModel):
    code: str | None
    message: str | None
    param: str | None


class RequestUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    gpu_seconds: float
    cost: float


class RequestObject(BaseModel):
    """sluice: a single chat or completion request, run as a batch's line is."""

    id: str
    object: Literal["request"] = "request"
    endpoint: str
    model: str
    status: Literal["queued", "running", "completed", "failed", "cancelled", "expired"]
    created_at: int
    completed_at: int | None
    response: dict[str, Any] | None = Field(description="the chat.completion or text_completion object")
    error: RequestError | None
    usage: RequestUsage | None


class UsageTotals(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_seconds: float
    cost: float


class UsageRow(UsageTotals):
    day: str = Field(description="YYYY-MM-DD (UTC) on which the results finished")
    batch_id: str = Field(description="a batch's id, or a single request's (req_...)")


class UsageReport(BaseModel):
    object: Literal["usage"] = "usage"
    tenant: str
    start_time: int
    end_time: int
    data: list[UsageRow]
    total: UsageTotals


class EfficiencyWindowObject(BaseModel):
    worker_id: str
    model: str
    window_start: float
    window_end: float
    steps: int
    prefill_tokens: int
    decode_tokens: int
    mean_running_seqs: float
    max_running_seqs: int
    max_num_seqs: int
    token_budget_use: float
    kv_cache_use: float
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    busy_seconds: float
    idle_seconds: float


class EfficiencyReport(BaseModel):
    object: Literal["list"] = "list"
    batch_id: str
    model: str
    start: float
    end: float
    data: list[EfficiencyWindowObject] = Field(description="windows of the model's workers that overlap the batch")


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    created_at: int


class WebhookEndpointWithSecret(WebhookEndpointObject):
    secret: str = Field(description="whsec_...: verifies the signatures; shown only now")


class WebhookEndpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool


class WebhookDeliveryObject(BaseModel):
    id: str = Field(description="the webhook-id header of every attempt")
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_type: str
    payload: dict[str, Any]
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: int | None
    last_status_code: int | None
    last_error: str | None
    created_at: int
    delivered_at: int | None


class WebhookDeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ModelObject(BaseModel):
    """OpenAI's Model, with vLLM's `root` and `parent`: a LoRA adapter's parent is the base model it runs on."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    root: str | None = Field(description="vLLM's: the checkpoint (or adapter) directory a worker loaded; null for a "
                                         "name known only from SLUICE_MODELS")
    parent: str | None = Field(description="vLLM's: a LoRA adapter's base model; null for a base model")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]
