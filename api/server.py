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

from sluice.api import (
    errors,
    routes_batches,
    routes_files,
    routes_models,
    routes_requests,
    routes_usage,
    routes_webhooks,
)
from sluice.api.auth import metrics_access
from sluice.api.body_guard import BodyGuard, Limit
from sluice.api.deps import Services, ServicesDep
from sluice.api.errors import ErrorResponse
from sluice.api.metrics import make_registry
from sluice.api.settings import Settings

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


def body_limit(max_bytes: int) -> Limit:
    """Every other POST under /v1 (JSON bodies, api.body_guard): none needs more than a file may hold, a single
    request being one line of one."""
    return Limit(lambda path: path.startswith("/v1/") and path != routes_files.router.prefix, max_bytes,
                 "the request body", f"bodies are limited to {max_bytes} bytes (SLUICE_MAX_FILE_BYTES)", None,
                 "request_too_large")


def create_app(sessions: sessionmaker[Session], celery: Celery, settings: Settings | None = None) -> FastAPI:
    svc = Services(sessions, celery, settings or Settings.from_env())
    app = FastAPI(title="sluice", summary="Self-hosted batch LLM inference, compatible with OpenAI's Files and "
                  "Batches API", version="0.1.0")
    app.state.services = svc
    app.state.metrics = make_registry(svc)
    errors.install(app)
    for limit in (routes_files.upload_limit, body_limit):
        app.add_middleware(BodyGuard, limit=limit(svc.settings.max_file_bytes), sessions=svc.sessions)
    for module in (routes_files, routes_batches, routes_requests, routes_models, routes_usage, routes_webhooks):
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

    from sluice.api import db
    from sluice.api.queue import make_app

    app = create_app(db.session_factory(db.make_engine(pool_size=API_THREADS)), make_app(), Settings.from_env())
    uvicorn.run(app, host=host, port=port)
