"""Creating a batch from an uploaded file: every line validated, all request rows written in one transaction.

A bad line becomes a failed request whose result holds the error, so the error file shows it; the batch itself
fails only when the file as a whole is unusable: empty, not JSONL at all, or longer than the line limit. A batch has
one endpoint and one model, as in OpenAI: given by the caller, or else taken from its first valid line. Its lines may
also mix a base model with the LoRA adapters served on it (`parents`: adapter -> base); such a batch's model, which
names its queue, is the base, and each stored body keeps the name it runs under.

A single request (POST /v1/requests) is stored as a one-request batch of its own, with an id of its own prefix
(req_...), so that it runs, is accounted and expires exactly as a batch's line does.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.api.batch_lines import BODIES, BatchRequest, BatchValidator, LineError, line_error, parse_line
from sluice.api.prefix_order import prefix_groups, prefix_key, prefix_order_enabled, prompt_text
from sluice.api.store.common import REQUEST_PREFIX, InvalidInput, error_result, insert_rows, new_id
from sluice.api.store.files import MAX_FILE_BYTES, file_content, get_file, store_file
from sluice.api.store.lifecycle import settle
from sluice.api.store.tenants import get_or_create_tenant
from sluice.api.store.views import owned_view
from sluice.api.store.webhooks import notify
from sluice.api.tables import Batch, Request, Result
from sluice.api.text import valid_unicode

MAX_LINES = 50_000  # OpenAI's limit of requests per batch
DEFAULT_PRIORITY = 5
PRIORITIES = range(10)  # 0 runs first: Redis and the engine both serve lower numbers first
INVALID_STATUS_CODE = 400
WINDOW = re.compile(r"([1-9][0-9]{0,3})h")
METADATA_LIMITS = (16, 64, 512)  # OpenAI's: pairs, key characters, value characters
MAX_CUSTOM_ID = 512
MAX_MODEL_NAME = 255


@dataclass
class Work:
    """Requests to publish to one model's queue at one priority."""

    model: str
    priority: int
    request_ids: list[int]
    # request ids whose prompts share a prefix (api/prefix_order.py), in the order to publish: a chunk never splits
    # one that fits in it. None: request_ids in order, chunked as they come
    groups: list[list[int]] | None = None


@dataclass
class _Rules:
    """What a valid line must also be in this batch: of its endpoint and model (given by the caller or by the first
    valid line), and storable."""

    endpoint: str | None
    model: str | None
    model_given: bool
    parents: Mapping[str, str] = field(default_factory=dict)  # LoRA adapter -> the base model it runs on
    mixed: bool = False  # lines name more than one of a base model and its adapters

    def batch_model(self) -> str:
        """The model whose queue the batch goes to: a mixed batch's base model."""
        if self.model is None:
            return ""
        return self.parents.get(self.model, self.model) if self.mixed else self.model

    def check(self, request: BatchRequest) -> BatchRequest | LineError:
        # PostgreSQL text holds no NUL character, and an index entry at most ~2.7 kB
        if len(request.custom_id) > MAX_CUSTOM_ID or "\x00" in request.custom_id:
            return line_error(request.line, "invalid_value", f"at most {MAX_CUSTOM_ID} characters, none of them NUL",
                              request.custom_id, "custom_id")
        self.endpoint = self.endpoint or request.url
        if request.url != self.endpoint:
            return line_error(request.line, "invalid_url", f"{request.url} differs from the batch's endpoint "
                              f"{self.endpoint}; a batch has one endpoint", request.custom_id, "url")
        if self.model_given:  # the lines' own `model` is ignored: each runs under the one given
            request.body = request.body.model_copy(update={"model": self.model})
            return request
        named = request.body.model
        if named is None:
            return line_error(request.line, "missing_required_parameter", "required field is missing: each line "
                              "names its model (`sluice submit --model NAME` gives a whole file one)",
                              request.custom_id, "body.model")
        if problem := _model_problem(named):
            return line_error(request.line, "invalid_value", problem, request.custom_id, "body.model")
        self.model = self.model or named
        if named != self.model:
            if self.parents.get(named, named) != self.parents.get(self.model, self.model):
                return line_error(request.line, "invalid_value", f"{named!r} differs from the batch's model "
                                  f"{self.model!r}; a batch runs on one model (or on one base model and LoRA "
                                  f"adapters served on it)", request.custom_id, "body.model")
            self.mixed = True
        return request


def create_batch(session: Session, tenant_id: int, input_file_id: str, *, endpoint: str | None = None,
                 model: str | None = None, completion_window: str = "24h", metadata: dict[str, str] | None = None,
                 priority: int = DEFAULT_PRIORITY, max_lines: int = MAX_LINES,
                 parents: Mapping[str, str] | None = None) -> tuple[Batch, Work | None]:
    """Validate the file's lines and store the batch with its requests; returns the batch and the work to publish
    after commit (None when nothing is left to run). `parents`: the LoRA adapters known to be served, each with its
    base model (adapter_parents). A bad argument raises InvalidInput and stores nothing."""
    if (view := owned_view(session, input_file_id, tenant_id)) is not None:  # files.retrieve finds it: not a 404
        raise InvalidInput(f"file {input_file_id} is the {view[0]} file of batch {view[1].id} (purpose "
                           "'batch_output'); a batch needs an uploaded file of purpose 'batch'", "input_file_id")
    file = get_file(session, input_file_id, tenant_id)
    if file.purpose != "batch":
        raise InvalidInput(f"file {input_file_id} has purpose {file.purpose!r}; a batch needs purpose 'batch'",
                           "input_file_id")
    if endpoint is not None and endpoint not in BODIES:
        raise InvalidInput(f"endpoint {endpoint!r} is not supported; use one of {', '.join(BODIES)}", "endpoint")
    if model is not None and (problem := _model_problem(model)):
        raise InvalidInput(f"model {model!r}: {problem}", "model")
    if priority not in PRIORITIES:
        raise InvalidInput(f"priority {priority} is out of range: 0 (first) to 9 (last)", "priority")
    window_seconds = _window_seconds(completion_window)
    _check_metadata(metadata)
    now = time.time()
    batch = Batch(id=new_id("batch_"), tenant_id=tenant_id, endpoint=endpoint or "", input_file_id=input_file_id,
                  completion_window=completion_window, model=model or "", priority=priority, status="validating",
                  metadata_=metadata, request_total=0, request_completed=0, request_failed=0, created_at=now,
                  expires_at=now + window_seconds)
    session.add(batch)
    lines = _lines(file_content(session, input_file_id))
    if problem := _file_problem(lines, max_lines):
        return _fail(session, batch, problem, now), None
    rules = _Rules(endpoint, model, model is not None, parents or {})
    validator = BatchValidator()
    checked = [_checked(validator, rules, number, raw) for number, raw in lines]
    if all(_not_json(c) for c in checked):
        return _fail(session, batch, {"code": "invalid_jsonl", "message": f"no line is a JSON object; "
                                      f"{checked[0].message}", "param": None, "line": None}, now), None
    batch.endpoint, batch.model = rules.endpoint or "", rules.batch_model()
    batch.status, batch.in_progress_at = "in_progress", now
    batch.request_total = len(checked)
    batch.request_failed = sum(isinstance(c, LineError) for c in checked)
    session.flush()
    insert_rows(session, Request.__table__, [_request_row(batch.id, c, now) for c in checked])
    ids = session.scalars(select(Request.id).where(Request.batch_id == batch.id).order_by(Request.line)).all()
    errors = [error_result(request_id, batch.id, c.line, INVALID_STATUS_CODE,
                           {"code": c.code, "message": c.message, "param": c.param, "custom_id": c.custom_id}, now)
              for request_id, c in zip(ids, checked) if isinstance(c, LineError)]
    insert_rows(session, Result.__table__, errors)
    queued = [request_id for request_id, c in zip(ids, checked) if isinstance(c, BatchRequest)]
    if not queued:
        settle(session, batch.id, now)
        session.refresh(batch)
        return batch, None
    return batch, Work(batch.model, priority, queued, _prefix_groups(ids, checked))


def _prefix_groups(ids: list[int], checked: list[BatchRequest | LineError]) -> list[list[int]] | None:
    """The valid lines' request ids grouped by shared prompt prefix (SLUICE_PREFIX_ORDER=0: file order)."""
    if not prefix_order_enabled():
        return None
    valid = [(request_id, c) for request_id, c in zip(ids, checked) if isinstance(c, BatchRequest)]
    keys = [prefix_key(prompt_text(c.body)) for _, c in valid]
    return [[valid[i][0] for i in group] for group in prefix_groups(keys)]


def submit_jsonl(session: Session, tenant: str, filename: str, data: bytes, max_bytes: int = MAX_FILE_BYTES,
                 **batch_options: Any) -> tuple[Batch, Work | None]:
    """Store `data` as the tenant's batch input file (creating the tenant if new) and create a batch from it: what
    `sluice submit` does in one transaction. `batch_options` are create_batch's."""
    owner = get_or_create_tenant(session, tenant)
    file = store_file(session, owner.id, filename, "batch", data, max_bytes)
    return create_batch(session, owner.id, file.id, **batch_options)


def input_file_problem(data: bytes, max_lines: int = MAX_LINES) -> dict[str, Any] | None:
    """Why a batch input file is unusable as a whole (empty, too many lines, no line a JSON object), as a batch error;
    None when a batch can be made of it. The API refuses such an upload rather than fail every batch made of it."""
    lines = _lines(data)
    if problem := _file_problem(lines, max_lines):
        return problem
    first = None
    for number, raw in lines:  # as create_batch judges them: parsed the same way, one at a time
        checked = parse_line(raw, number)
        if not _not_json(checked):
            return None
        first = first or checked
    return {"code": "invalid_jsonl", "message": f"the file is not JSONL: no line is a JSON object; {first.message}",
            "param": None, "line": first.line}


def create_request(session: Session, tenant_id: int, endpoint: str, body: dict[str, Any],
                   completion_window: str = "24h") -> tuple[Batch, Work]:
    """Store one chat or completion body, whose `model` names the served model, as a one-request batch; returns it
    and the work to publish after commit. A bad body raises InvalidInput naming the field; nothing is stored."""
    if endpoint not in BODIES:
        raise InvalidInput(f"endpoint {endpoint!r} is not supported; use one of {', '.join(BODIES)}", "endpoint")
    request_id = new_id(REQUEST_PREFIX)
    line = json.dumps({"custom_id": request_id, "method": "POST", "url": endpoint, "body": body})
    checked = parse_line(line, 1)
    if isinstance(checked, LineError):  # refused as its batch line would be, with that line's error code
        raise InvalidInput(checked.message.removeprefix("line 1: "), checked.param, checked.code)
    model = checked.body.model
    if model is None:
        raise InvalidInput("body.model: required field is missing", "body.model", "missing_required_parameter")
    if problem := _model_problem(model):
        raise InvalidInput(f"body.model: {problem}", "body.model")
    now = time.time()
    batch = Batch(id=request_id, tenant_id=tenant_id, endpoint=endpoint, input_file_id="",
                  completion_window=completion_window, model=model, priority=DEFAULT_PRIORITY, status="in_progress",
                  request_total=1, request_completed=0, request_failed=0, created_at=now, in_progress_at=now,
                  expires_at=now + _window_seconds(completion_window))
    session.add(batch)
    session.flush()
    insert_rows(session, Request.__table__, [_request_row(batch.id, checked, now)])
    request_ids = list(session.scalars(select(Request.id).where(Request.batch_id == batch.id)))
    return batch, Work(model, DEFAULT_PRIORITY, request_ids)


def _lines(data: bytes) -> list[tuple[int, bytes]]:
    return [(number, raw) for number, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]


def _model_problem(name: str) -> str | None:
    if not name.strip() or len(name) > MAX_MODEL_NAME or "\x00" in name:
        return f"a model name has 1 to {MAX_MODEL_NAME} characters, not all blank, none of them NUL"
    return None


def _not_json(checked: BatchRequest | LineError) -> bool:
    return isinstance(checked, LineError) and checked.code == "invalid_json_line"


def _checked(validator: BatchValidator, rules: _Rules, number: int, raw: bytes) -> BatchRequest | LineError:
    result = validator.validate(raw, number)
    return rules.check(result) if isinstance(result, BatchRequest) else result


def _fail(session: Session, batch: Batch, error: dict[str, Any], now: float) -> Batch:
    batch.status, batch.failed_at, batch.errors = "failed", now, [error]
    session.flush()
    notify(session, batch.tenant_id, "batch.failed", batch.id, now)
    return batch


def _file_problem(lines: list[tuple[int, bytes]], max_lines: int) -> dict[str, Any] | None:
    if not lines:
        return {"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None}
    if len(lines) > max_lines:
        return {"code": "too_many_lines", "message": f"the input file has {len(lines)} requests; a batch takes at "
                f"most {max_lines}", "param": None, "line": max_lines + 1}
    return None


def _request_row(batch_id: str, checked: BatchRequest | LineError, now: float) -> dict[str, Any]:
    row = {"batch_id": batch_id, "line": checked.line, "attempts": 0, "lease_owner": None, "lease_expires_at": None,
           "created_at": now}
    if isinstance(checked, LineError):
        # no custom_id: a duplicate must not collide with its first use; the error result keeps it
        return {**row, "custom_id": None, "url": None, "body": None, "status": "failed", "published_at": None}
    body = checked.body.model_dump(mode="json", exclude_none=True)
    return {**row, "custom_id": checked.custom_id, "url": checked.url, "body": body, "status": "queued",
            "published_at": now}


def _window_seconds(window: str) -> int:
    match = WINDOW.fullmatch(window)
    if match is None:
        raise InvalidInput(f"completion_window {window!r}: give hours, as in '24h'", "completion_window")
    return int(match[1]) * 3600


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    pairs, key_chars, value_chars = METADATA_LIMITS
    if not isinstance(metadata, dict) or len(metadata) > pairs:
        raise InvalidInput(f"metadata: at most {pairs} key-value pairs", "metadata")
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)) or len(key) > key_chars or len(value) > value_chars:
            raise InvalidInput(f"metadata[{key!r}]: keys are strings of at most {key_chars} characters, values of "
                               f"at most {value_chars}", "metadata")
        if not (valid_unicode(key) and valid_unicode(value)):  # JSON's lone \uD800-\uDFFF escapes: no UTF-8 holds them
            raise InvalidInput(f"metadata[{key!r}]: contains a lone UTF-16 surrogate escape, which is not valid "
                               "Unicode", "metadata")
