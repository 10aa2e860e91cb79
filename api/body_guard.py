"""Checks a POST's API key before its body is read, and refuses a body past a limit as it arrives.

FastAPI reads (and parses, or spools) a body before it resolves the route's dependencies, the key among them: without
this anyone could have the server hold a body of any size. The caller found is kept in the request's state, so the
route's dependency does not look the key up again (api.auth.caller).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.auth import authenticate_scope
from sluice.api.errors import ApiError, error_response


@dataclass(frozen=True)
class Limit:
    """Which POSTs a guard takes (by path), how many bytes their bodies may hold, and how a refusal reads."""

    applies: Callable[[str], bool]
    max_bytes: int
    what: str  # "the upload": "{what} has N bytes; ..."
    rule: str  # "files are limited to N bytes (SLUICE_MAX_FILE_BYTES)"
    param: str | None
    code: str

    def refusal(self, size: str) -> str:
        return f"{self.what} {size} bytes; {self.rule}"


class TooLarge(ApiError, HTTPException):
    """A 413 raised while the body is read: FastAPI lets an HTTPException out of its body parsing (any other error
    becomes its 400), and the handler of ApiError, first in this class's MRO, answers it as the other refusals."""

    def __init__(self, message: str, param: str | None, code: str):
        HTTPException.__init__(self, 413, message)
        self.status, self.message, self.param, self.code = 413, message, param, code


class BodyGuard:
    def __init__(self, app: ASGIApp, limit: Limit, sessions: sessionmaker[Session]):
        self.app, self.limit, self.sessions = app, limit, sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and self.limit.applies(scope["path"])):
            await self.app(scope, receive, send)
            return
        try:
            await run_in_threadpool(authenticate_scope, self.sessions, scope)
        except ApiError as e:
            await error_response(e.status, e.message, e.param, e.code, {"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        limit = self.limit
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > limit.max_bytes:
            await error_response(413, limit.refusal(f"has {int(length)}"), limit.param, limit.code)(
                scope, receive, send)
            return
        received = 0

        async def counted() -> Message:  # a body sent without a length (chunked): refused as it passes the limit
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit.max_bytes:
                raise TooLarge(limit.refusal(f"has more than {limit.max_bytes}"), limit.param, limit.code)
            return message

        await self.app(scope, counted, send)
