"""Who is calling: the tenant of the `Authorization: Bearer <key>` API key, and the optional token of /metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.datastructures import Headers
from starlette.types import Scope

from sluice.api import store
from sluice.api.deps import ServicesDep
from sluice.api.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="an API key from `sluice keys create --tenant NAME`")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
CHECKED = "sluice_checked_key"  # request state: (key, Caller) of a key authenticated before the request was parsed


@dataclass(frozen=True)
class Caller:
    tenant_id: int
    tenant: str
    key_id: str


def caller(request: Request, svc: ServicesDep, credentials: Credentials) -> Caller:
    """The caller of the request's key: the one a check before parsing (authenticate_scope) found for that very key,
    else looked up now."""
    key = credentials and credentials.credentials
    checked = getattr(request.state, CHECKED, None)
    if checked is not None and key is not None and checked[0] == key:
        return checked[1]
    return authenticate(svc.sessions, key)


def authenticate(sessions: sessionmaker[Session], key: str | None) -> Caller:
    if key is None:
        raise ApiError(401, "no API key given: send the header `Authorization: Bearer <key>` (keys come from "
                            "`sluice keys create --tenant NAME`)", code="missing_api_key")
    with sessions.begin() as session:
        found = store.resolve_api_key(session, key)
    if found is None:
        raise ApiError(401, f"incorrect API key provided: {_hint(key)} is unknown or revoked", code="invalid_api_key")
    tenant, key_id = found
    return Caller(tenant.id, tenant.name, key_id)


def hold_key(session: Session, me: Caller) -> None:
    """In a transaction that creates something in the caller's name: its key, checked when the request began (an
    upload's body may take minutes after that), must not have been revoked since, and is held so until the commit."""
    if not store.hold_live_key(session, me.key_id):
        raise ApiError(401, f"API key {me.key_id} was revoked while this request ran: nothing was stored",
                       code="invalid_api_key")


def authenticate_scope(sessions: sessionmaker[Session], scope: Scope) -> Caller:
    """authenticate() for a check before FastAPI has parsed the request (api.body_guard). The caller is kept, with
    its key, in the request's ASGI state (a copy per request), where the route's `caller` finds it instead of looking
    the same key up again."""
    key = bearer_key(scope)
    me = authenticate(sessions, key)
    scope.setdefault("state", {})[CHECKED] = (key, me)
    return me


def bearer_key(scope: Scope) -> str | None:
    """The key of an ASGI request's headers, read as HTTPBearer reads it (the first Authorization header)."""
    scheme, _, key = (Headers(scope=scope).get("authorization") or "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def metrics_access(svc: ServicesDep, credentials: Credentials) -> None:
    token = svc.settings.metrics_token
    if token is None:
        return
    if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise ApiError(401, "GET /metrics needs `Authorization: Bearer <SLUICE_METRICS_TOKEN>`",
                       code="invalid_api_key")


def _hint(key: str) -> str:
    """Enough of a key to recognise it in a log, never enough to use it."""
    return f"{key[:14]}...{key[-4:]}" if len(key) > 24 else "the key"


CallerDep = Annotated[Caller, Depends(caller)]
