"""Who is calling: the tenant of the `Authorization: Bearer <key>` API key, and the optional token of /metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from api import store
from api.deps import ServicesDep
from api.errors import ApiError

bearer = HTTPBearer(auto_error=False, description="an API key from `sluice keys create --tenant NAME`")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


@dataclass(frozen=True)
class Caller:
    tenant_id: int
    tenant: str


def caller(svc: ServicesDep, credentials: Credentials) -> Caller:
    return authenticate(svc.sessions, credentials and credentials.credentials)


def authenticate(sessions: sessionmaker[Session], key: str | None) -> Caller:
    if key is None:
        raise ApiError(401, "no API key given: send the header `Authorization: Bearer <key>` (keys come from "
                            "`sluice keys create --tenant NAME`)", code="missing_api_key")
    with sessions.begin() as session:
        tenant = store.resolve_api_key(session, key)
    if tenant is None:
        raise ApiError(401, f"incorrect API key provided: {_hint(key)} is unknown or revoked", code="invalid_api_key")
    return Caller(tenant.id, tenant.name)


def bearer_key(headers: dict[bytes, bytes]) -> str | None:
    """The key of raw ASGI headers, as HTTPBearer reads it: for a check before FastAPI has parsed the request."""
    scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
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
