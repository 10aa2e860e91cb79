"""The FastAPI app: OpenAI's Files and Batches API, sluice's own routes, metrics and health, over given services.

`create_app` takes its database sessions, Celery app and settings explicitly, so that a test or `sluice serve` can
run it against anything; `serve` is `sluice api`, configured from the environment (SLUICE_DATABASE_URL,
SLUICE_BROKER_URL, and the limits in api.settings). Every /v1 route needs `Authorization: Bearer <key>`;
/healthz, /readyz and /metrics (unless SLUICE_METRICS_TOKEN is set) do not.
"""

from __future__ import annotations

import logging
from typing import Annotated

from celery import Celery
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors, routes_batches, routes_files, routes_requests, routes_usage, routes_webhooks
from api.auth import authenticate_scope, metrics_access
from api.deps import Services, ServicesDep
from api.errors import ApiError, ErrorResponse, error_response
from api.metrics import make_registry
from api.settings import Settings

BROKER_CHECK_SECONDS = 2.0
# FastAPI runs the sync routes on anyio's worker threads, 40 by default: a database connection kept for each, else
# past SQLAlchemy's default pool (5 kept, 10 more opened per use) concurrent requests wait for one or open their own
API_THREADS = 40
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500)}

ops = APIRouter(tags=["operations"])
log = logging.getLogger(__name__)


@ops.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@ops.get("/readyz", summary="The database and the broker are reachable", responses={503: {"model": dict}})
def readyz(svc: ServicesDep) -> JSONResponse:
    problems = {}
    try:
        with svc.sessions() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError as e:
        problems["database"] = _unreachable("database", str(getattr(e, "orig", None) or e).splitlines()[0])
    try:
        with svc.celery.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, timeout=BROKER_CHECK_SECONDS)
    except Exception as e:  # kombu raises the transport's own errors
        problems["broker"] = _unreachable("broker", f"{type(e).__name__}: {e}")
    if problems:
        return JSONResponse({"status": "unavailable", **problems}, status_code=503)
    return JSONResponse({"status": "ok"})


def _unreachable(what: str, why: str) -> str:
    """Why is logged, not answered: /readyz needs no key, and the driver's error names internal hosts, ports and
    database users."""
    log.warning("/readyz: the %s is unreachable: %s", what, why)
    return "unreachable (the API server's log says why)"


@ops.get("/metrics", response_class=Response, summary="Prometheus metrics",
         responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: {"model": ErrorResponse}})
def metrics(request: Request, _access: Annotated[None, Depends(metrics_access)]) -> Response:
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


class BodyTooLarge(ApiError, HTTPException):
    """A 413 raised while a JSON body is read: FastAPI lets an HTTPException out of its body parsing (any other error
    becomes its 400), and the handler of ApiError, first in this class's MRO, answers it as the other refusals."""

    def __init__(self, message: str):
        HTTPException.__init__(self, 413, message)
        self.status, self.message, self.param, self.code = 413, message, None, "request_too_large"


class BodyLimit:
    """Refuses a JSON body (every POST under /v1 but the upload, which routes_files.UploadLimit guards) before the
    server reads it when its caller has no valid key, and as soon as it passes the file limit: FastAPI reads and
    parses a body before it resolves the route's dependencies, the key among them, so anyone could have the server
    hold a body of any size. No body needs more than a file may hold: a single request is one line of one."""

    def __init__(self, app: ASGIApp, max_bytes: int, sessions: sessionmaker[Session]):
        self.app, self.max_bytes, self.sessions = app, max_bytes, sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if not (scope["type"] == "http" and scope["method"] == "POST" and path.startswith("/v1/")
                and path != routes_files.router.prefix):
            await self.app(scope, receive, send)
            return
        try:  # the caller is kept in the request's state: the route's dependency does not look the key up again
            await run_in_threadpool(authenticate_scope, self.sessions, scope)
        except ApiError as e:
            await error_response(e.status, e.message, e.param, e.code, {"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, self._too_large(f"has {int(length)}"), None, "request_too_large")(
                scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self._too_large(f"has more than {self.max_bytes}"))
            return message

        await self.app(scope, counted, send)

    def _too_large(self, size: str) -> str:
        return f"the request body {size} bytes; bodies are limited to {self.max_bytes} (SLUICE_MAX_FILE_BYTES)"


def create_app(sessions: sessionmaker[Session], celery: Celery, settings: Settings | None = None) -> FastAPI:
    svc = Services(sessions, celery, settings or Settings.from_env())
    app = FastAPI(title="sluice", summary="Self-hosted batch LLM inference, compatible with OpenAI's Files and "
                  "Batches API", version="0.1.0")
    app.state.services = svc
    app.state.metrics = make_registry(svc)
    errors.install(app)
    app.add_middleware(routes_files.UploadLimit, max_bytes=svc.settings.max_file_bytes, sessions=svc.sessions)
    app.add_middleware(BodyLimit, max_bytes=svc.settings.max_file_bytes, sessions=svc.sessions)
    for module in (routes_files, routes_batches, routes_requests, routes_usage, routes_webhooks):
        app.include_router(module.router, responses=ERRORS)
    app.include_router(ops)
    generate = app.openapi
    app.openapi = lambda: _openapi(app, generate)
    return app


def _openapi(app: FastAPI, generate) -> dict:
    """FastAPI's document, told what this app really does: schema errors answer 400 (OpenAI's way), not 422, and
    /metrics takes a token only when SLUICE_METRICS_TOKEN is set."""
    if app.openapi_schema is None:
        schema = generate()
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if path == "/metrics":
                    operation["security"] = [{}, *operation["security"]]
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
    return app.openapi_schema


def serve(host: str, port: int) -> None:
    import uvicorn

    from api import db
    from api.queue import make_app

    app = create_app(db.session_factory(db.make_engine(pool_size=API_THREADS)), make_app(), Settings.from_env())
    uvicorn.run(app, host=host, port=port)
