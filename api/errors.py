"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the status codes its SDK maps.

Every refusal goes through here: the store's (NotFound 404, Conflict 409, InvalidInput 400), a request that does not
fit its schema (400, as OpenAI answers it, naming each field), an unknown route (404) and any crash (500).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match

from sluice.api.store import Conflict, InvalidInput, NotFound, StoreError
from sluice.api.text import readable

VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
VALIDATION_DETAILS = {"missing": "required field is missing", "extra_forbidden": "unknown field"}
# the openai SDK retries a 409 (a lock timeout, to OpenAI) unless told not to; sluice's conflicts are final
NO_RETRY = {"x-should-retry": "false"}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"
    # a message may quote what was given, lone surrogates included, which UTF-8 cannot encode: escape them
    body = ErrorResponse(error=ErrorBody(message=readable(message), type=kind, param=param and readable(param),
                                         code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)


async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return error_response(e.status, e.message, e.param, e.code, headers)


async def _store_error(_request: Request, e: StoreError) -> JSONResponse:
    if isinstance(e, NotFound):
        return error_response(404, str(e), code="not_found")
    if isinstance(e, Conflict):
        return error_response(409, str(e), e.param, "conflict", NO_RETRY)
    if isinstance(e, InvalidInput):
        return error_response(400, str(e), e.param, e.code)
    return error_response(400, str(e), code="invalid_value")


async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
    problems = e.errors()
    first = problems[0]
    if first["type"] == "json_invalid":  # its loc holds a character position, not a field
        return error_response(400, f"the request body is not valid JSON ({first['ctx']['error']} at character "
                                   f"{first['loc'][-1]})", None, "invalid_json")
    described = []
    for p in problems:
        where = ".".join(str(part) for part in p["loc"][1:])  # loc[0] is body, query or path
        detail = VALIDATION_DETAILS.get(p["type"], p["msg"])
        described.append(f"{where}: {detail}" if where else f"the request {p['loc'][0]}: {detail}")
    param = ".".join(str(part) for part in first["loc"][1:]) or None
    return error_response(400, "; ".join(described), param, VALIDATION_CODES.get(first["type"], "invalid_value"))


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    call = f"{request.method} {request.url.path}"
    if e.status_code == 404:  # no route: say which, since a base_url without /v1 is a common slip
        return error_response(404, f"no route {call}: the API's routes are under /v1 (an SDK's base_url ends in "
                                   "/v1)", code="unknown_url")
    if e.status_code == 405:
        allowed = ", ".join(_allowed_methods(request))
        return error_response(405, f"{call} is not allowed; this path takes {allowed}", code="method_not_allowed",
                              headers={"Allow": allowed})
    return error_response(e.status_code, str(e.detail), headers=e.headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at this path (Starlette's 405 names only the first such route's), asked of the
    routes themselves: FastAPI's included routers do not list their routes' methods."""
    return [method for method in METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                   for route in request.app.routes)]


async def _crash(_request: Request, _e: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this answer, so the server logs its traceback
    return error_response(500, "the server failed to handle this request; it is logged", code="server_error")
