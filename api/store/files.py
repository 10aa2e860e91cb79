"""Uploaded files: metadata in `files`, bytes in `file_contents`, so that every API host serves the same files."""

from __future__ import annotations

import time

from sqlalchemy import LargeBinary, func, select
from sqlalchemy.orm import Session

from sluice.api.store.common import InvalidInput, NotFound, new_id
from sluice.api.store.ids import findable
from sluice.api.tables import File, FileContent

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for batch input files
PURPOSES = ("batch",)


def store_file(session: Session, tenant_id: int, filename: str, purpose: str, data: bytes,
               max_bytes: int = MAX_FILE_BYTES) -> File:
    if purpose not in PURPOSES:
        raise InvalidInput(f"purpose {purpose!r} is not supported; use one of {', '.join(PURPOSES)}", "purpose")
    if len(data) > max_bytes:
        raise InvalidInput(f"file {filename!r} has {len(data)} bytes; the limit is {max_bytes}", "file")
    if not filename or len(filename) > 255 or "\x00" in filename:
        raise InvalidInput("a file needs a name of 1 to 255 characters, none of them NUL", "file")
    file = File(id=new_id("file-"), tenant_id=tenant_id, filename=filename, purpose=purpose, bytes=len(data),
                status="processed", created_at=time.time())
    session.add(file)
    session.flush()
    session.add(FileContent(file_id=file.id, data=data))
    session.flush()
    return file


def get_file(session: Session, file_id: str, tenant_id: int | None = None) -> File:
    """The file, if it exists and (when tenant_id is given) belongs to that tenant: another's is not found."""
    file = session.get(File, file_id) if findable(file_id) else None
    if file is None or (tenant_id is not None and file.tenant_id != tenant_id):
        raise NotFound(f"file {file_id} not found")
    return file


def file_content(session: Session, file_id: str) -> bytes:
    data = session.scalar(select(FileContent.data).where(FileContent.file_id == file_id))
    if data is None:
        raise NotFound(f"file {file_id} not found")
    return data


def file_slice(session: Session, file_id: str, start: int, size: int) -> bytes:
    """Up to `size` bytes of a file's content from byte `start` (empty past its end, or once it is deleted): what a
    download streams, so that no host holds a whole file (psycopg's hex transfer made one 6x its size in memory)."""
    return session.scalar(select(func.substr(FileContent.data, start + 1, size, type_=LargeBinary))
                          .where(FileContent.file_id == file_id)) or b""
