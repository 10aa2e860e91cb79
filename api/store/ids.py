"""Ids in queries: a list of request ids as one bound parameter, `column = ANY(CAST(%(ids)s AS BIGINT[]))` on
PostgreSQL, `column IN (SELECT value FROM json_each(?))` on SQLite; and which text ids (and cursors) a lookup may bind
at all. Either way the parameter is text (an array literal, a JSON array): psycopg adapts a list of ints in Python,
one element at a time, where it sends a string as it is.

SQLAlchemy's expanding `in_()` renders one placeholder per id into the SQL on every execution, and psycopg then
adapts each one; on a worker's hot path (four statements a chunk) that rendering cost more client CPU than the rest
of the statement's handling (bench/NOTES.md). One parameter also keeps one SQL text, one prepared statement, for any
chunk size.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Boolean, ColumnElement, Text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import TypeDecorator

from sluice.api.text import storable


class IdList(TypeDecorator):
    """Integer ids, bound as text: a bigint[] literal on PostgreSQL ({1,2,3}), a JSON array on SQLite ([1,2,3])."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Iterable[int] | None, dialect):
        ids = ",".join(str(int(i)) for i in value or ())
        return f"{{{ids}}}" if dialect.name == "postgresql" else f"[{ids}]"


class InIds(ColumnElement[bool]):
    """`column` is one of the ids bound to `ids` (a bindparam of type IdList)."""

    inherit_cache = True
    type = Boolean()
    _traverse_internals = [("column", InternalTraversal.dp_clauseelement), ("ids", InternalTraversal.dp_clauseelement)]

    def __init__(self, column, ids):
        self.column, self.ids = column, ids


@compiles(InIds)
def _in_json_each(element: InIds, compiler, **kw) -> str:
    column, ids = compiler.process(element.column, **kw), compiler.process(element.ids, **kw)
    return f"{column} IN (SELECT value FROM json_each({ids}))"


@compiles(InIds, "postgresql")
def _any_array(element: InIds, compiler, **kw) -> str:
    return f"{compiler.process(element.column, **kw)} = ANY(CAST({compiler.process(element.ids, **kw)} AS BIGINT[]))"


def findable(text_id: str) -> bool:
    """Whether a row can have this id: PostgreSQL text holds no NUL and no lone surrogate (not UTF-8), and a query
    binding one fails instead of finding nothing. Callers answer not found (or a bad cursor) without asking."""
    return storable(text_id)
