"""What every route reaches through its request: the session factory, the Celery app and the settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from sluice.api.settings import Settings


@dataclass(frozen=True)
class Services:
    sessions: sessionmaker[Session]
    celery: Celery
    settings: Settings


def services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(services)]
