"""/v1/files: upload batch input files, list, read, download and delete them.

A batch's output and error files (file-out-batch_..., file-err-batch_...) are views over its result rows: they are
read and downloaded like uploads, streamed page by page in short transactions, partial while the batch runs, and
not listed or deletable on their own; their size is counted by rendering them, and kept in the batch's row once it
has ended. An upload that can only make a failed batch (empty, not JSONL, too many lines) is refused at once; a file
with some bad lines is accepted, and those lines go to the batch's error file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from sluice.api import store
from sluice.api.auth import CallerDep, hold_key
from sluice.api.body_guard import Limit
from sluice.api.deps import ServicesDep
from sluice.api.errors import ApiError, ErrorResponse
from sluice.api.rest_objects import FileDeleted, FileList, FileObject
from sluice.api.store.views import keep_file_bytes, kept_file_bytes
from sluice.api.tables import File as FileRow

router = APIRouter(prefix="/v1/files", tags=["files"])
STREAM_LINES = 1000
FILE_SLICE = 8 * 1024 * 1024  # bytes of a stored file read per transaction while downloading it
MULTIPART_SLACK = 64 * 1024  # room for the form's boundaries and the purpose field around the file itself
CONTENT = {200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes (JSONL)"}}


def upload_limit(max_bytes: int) -> Limit:
    """Uploads (api.body_guard): the file, plus its form's boundaries and fields."""
    return Limit(lambda path: path == router.prefix, max_bytes + MULTIPART_SLACK, "the upload",
                 f"files are limited to {max_bytes} bytes (SLUICE_MAX_FILE_BYTES)", "file", "file_too_large")


@router.post("", response_model=FileObject, summary="Upload a batch input file",
             responses={413: {"model": ErrorResponse}})
def upload_file(svc: ServicesDep, me: CallerDep, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
                expires_after: Annotated[str | None, Form(alias="expires_after[anchor]")] = None) -> FileObject:
    if expires_after is not None:  # the SDK's expires_after={...} as form fields; refused, not ignored
        raise ApiError(400, "expires_after is not supported: sluice keeps a file until it is deleted",
                       "expires_after", "unsupported_value")
    limit = svc.settings.max_file_bytes
    data = file.file.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"file {file.filename!r} is larger than the limit of {limit} bytes "
                            "(SLUICE_MAX_FILE_BYTES)", "file", "file_too_large")
    if purpose == "batch" and (problem := store.input_file_problem(data, svc.settings.max_batch_lines)):
        raise ApiError(400, f"file {file.filename!r}: {problem['message']}", "file", problem["code"])
    with svc.sessions.begin() as session:
        hold_key(session, me)
        row = store.store_file(session, me.tenant_id, file.filename or "", purpose, data, max_bytes=limit)
    return _file_object(row)


@router.get("", response_model=FileList, summary="List uploaded files")
def list_files(svc: ServicesDep, me: CallerDep, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, order: Literal["asc", "desc"] = "desc",
               purpose: str | None = None) -> FileList:
    with svc.sessions.begin() as session:
        rows, has_more = store.list_files(session, me.tenant_id, after, limit, order, purpose)
    data = [_file_object(row) for row in rows]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=has_more)


@router.get("/{file_id}", response_model=FileObject, summary="Get a file's metadata")
def get_file(svc: ServicesDep, me: CallerDep, file_id: str) -> FileObject:
    with svc.sessions.begin() as session:
        if (view := store.owned_view(session, file_id, me.tenant_id)) is None:
            return _file_object(store.get_file(session, file_id, me.tenant_id))
    kind, batch = view
    size = kept_file_bytes(batch, kind)
    if size is None:  # counted as downloaded; kept once the batch has ended, and read back after that
        size = sum(len(chunk) for chunk in _view_chunks(svc.sessions, batch.id, kind))
        with svc.sessions.begin() as session:
            size = keep_file_bytes(session, batch, kind, size)
    return FileObject(id=file_id, bytes=size, created_at=int(batch.created_at), filename=f"{batch.id}_{kind}.jsonl",
                      purpose="batch_output", status="processed")


@router.get("/{file_id}/content", response_class=Response, responses=CONTENT, summary="Download a file")
def file_content(svc: ServicesDep, me: CallerDep, file_id: str) -> Response:
    with svc.sessions.begin() as session:
        if (view := store.owned_view(session, file_id, me.tenant_id)) is not None:
            kind, batch = view
            return StreamingResponse(_view_chunks(svc.sessions, batch.id, kind), media_type="application/octet-stream",
                                     headers=_attachment(f"{batch.id}_{kind}.jsonl"))
        row = store.get_file(session, file_id, me.tenant_id)
    return StreamingResponse(_file_slices(svc.sessions, file_id, row.bytes), media_type="application/octet-stream",
                             headers={"content-length": str(row.bytes), **_attachment(row.filename or file_id)})


def _attachment(filename: str) -> dict[str, str]:
    """Content-Disposition naming the file as its FileObject does, so a browser or `curl -OJ` saves it by that name;
    any name that is not plain ASCII goes percent-encoded (RFC 6266's filename*), as Starlette's FileResponse does."""
    quoted = quote(filename)
    if quoted == filename:
        return {"content-disposition": f'attachment; filename="{filename}"'}
    return {"content-disposition": f"attachment; filename*=utf-8''{quoted}"}


@router.delete("/{file_id}", response_model=FileDeleted, summary="Delete an uploaded file")
def delete_file(svc: ServicesDep, me: CallerDep, file_id: str) -> FileDeleted:
    with svc.sessions.begin() as session:
        if (view := store.owned_view(session, file_id, me.tenant_id)) is not None:
            raise ApiError(400, f"{file_id} is the {view[0]} file of batch {view[1].id}, a view over its results; "
                                "it cannot be deleted on its own", "file_id", "invalid_value")
        store.delete_file(session, file_id, me.tenant_id)
    return FileDeleted(id=file_id, deleted=True)


def _file_slices(sessions: sessionmaker[Session], file_id: str, size: int) -> Iterator[bytes]:
    """A stored file's bytes, a slice per transaction; a file deleted meanwhile ends short of its Content-Length."""
    for start in range(0, size, FILE_SLICE):
        with sessions.begin() as session:
            data = store.file_slice(session, file_id, start, FILE_SLICE)
        if not data:
            return
        yield data


def _view_chunks(sessions: sessionmaker[Session], batch_id: str, kind: str) -> Iterator[bytes]:
    """The file's lines, a page per transaction, so that a long download holds no transaction (nor SQLite's lock)."""
    after = 0
    while True:
        with sessions.begin() as session:
            page = store.file_page(session, batch_id, kind, after, STREAM_LINES)
        if not page:
            return
        yield "".join(json.dumps(record, ensure_ascii=False) + "\n" for _, record in page).encode()
        after = page[-1][0]


def _file_object(row: FileRow) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at), filename=row.filename,
                      purpose=row.purpose, status=row.status)
