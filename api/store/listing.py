"""Cursor pages of a tenant's objects (files, batches, webhook deliveries) and deleting files.

A page is ordered by (created_at, id), newest first unless asked otherwise; `after` is the id of the last object of
the previous page, as in OpenAI's lists; a deleted file's id still marks its place. An `after` that is not in the list
is refused rather than read as the start.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import Select, and_, delete, or_, select
from sqlalchemy.orm import Session

from sluice.api.store.common import REQUEST_PREFIX, InvalidInput, NotFound
from sluice.api.store.files import get_file
from sluice.api.store.ids import findable
from sluice.api.tables import Batch, DeletedFile, File

Order = Literal["asc", "desc"]


def page(session: Session, stmt: Select, model, after: str | None, limit: int, order: Order = "desc",
         deleted: Select | None = None) -> tuple[list, bool]:
    """Up to `limit` rows of `stmt` (a select of `model`, already narrowed to one owner) following the row `after`;
    and whether more follow. `deleted`: (created_at, id) of the owner's deleted rows, where an `after` may be too."""
    created, ident = model.created_at, model.id
    if after is not None:
        at_after = stmt.with_only_columns(created, ident).where(ident == after)
        cursor = session.execute(at_after).first() if findable(after) else None
        if cursor is None and deleted is not None and findable(after):
            cursor = session.execute(deleted.where(deleted.selected_columns[1] == after)).first()
        if cursor is None:
            raise InvalidInput(f"after: {after!r} is not the id of an object in this list", "after")
        at, at_id = cursor
        if order == "desc":
            stmt = stmt.where(or_(created < at, and_(created == at, ident < at_id)))
        else:
            stmt = stmt.where(or_(created > at, and_(created == at, ident > at_id)))
    keys = (created.desc(), ident.desc()) if order == "desc" else (created, ident)
    rows = list(session.scalars(stmt.order_by(*keys).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_files(session: Session, tenant_id: int, after: str | None, limit: int, order: Order = "desc",
               purpose: str | None = None) -> tuple[list[File], bool]:
    stmt = select(File).where(File.tenant_id == tenant_id)
    if purpose is not None:
        if not findable(purpose):
            raise InvalidInput(f"purpose {purpose!r}: no file's purpose has a NUL character or a lone surrogate",
                               "purpose")
        stmt = stmt.where(File.purpose == purpose)
    deleted = select(DeletedFile.created_at, DeletedFile.id).where(DeletedFile.tenant_id == tenant_id)
    return page(session, stmt, File, after, limit, order, deleted)


def list_batches(session: Session, tenant_id: int, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """The tenant's batches, newest first; single requests (their one-request batches) are not listed."""
    stmt = select(Batch).where(Batch.tenant_id == tenant_id, ~Batch.id.startswith(REQUEST_PREFIX, autoescape=True))
    return page(session, stmt, Batch, after, limit)


def delete_file(session: Session, file_id: str, tenant_id: int) -> None:
    """Delete the file and its content; batches made from it keep their requests and keep naming it."""
    created_at = get_file(session, file_id, tenant_id).created_at
    # another host's delete of the same file may commit between the read and this: one delete succeeds, as in turn
    if session.execute(delete(File).where(File.id == file_id).returning(File.id)).first() is None:
        raise NotFound(f"file {file_id} not found")
    session.add(DeletedFile(id=file_id, tenant_id=tenant_id, created_at=created_at))
