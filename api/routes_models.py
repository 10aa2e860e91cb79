"""/v1/models: the served models and LoRA adapters, as OpenAI and vLLM list them: those live workers serve, and the
names SLUICE_MODELS accepts before their workers are up."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.orm import Session

from sluice.api import store
from sluice.api.auth import CallerDep
from sluice.api.deps import ServicesDep
from sluice.api.errors import ApiError
from sluice.api.rest_objects import ModelList, ModelObject
from sluice.api.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ModelList, summary="List the served models and LoRA adapters")
def list_models(svc: ServicesDep, _me: CallerDep) -> ModelList:
    with svc.sessions.begin() as session:
        return ModelList(data=served_models(session, svc.settings))


@router.get("/{model:path}", response_model=ModelObject, summary="Get a served model or LoRA adapter")
def get_model(svc: ServicesDep, _me: CallerDep, model: str) -> ModelObject:
    with svc.sessions.begin() as session:
        for served in served_models(session, svc.settings):
            if served.id == model:
                return served
    raise ApiError(404, f"model {model!r} is not served here", "model", "model_not_found")


def served_models(session: Session, settings: Settings) -> list[ModelObject]:
    """By name; a name several workers serve once, as the first of them to start loaded it."""
    models: dict[str, ModelObject] = {}
    for w in sorted(store.live_workers(session), key=lambda w: w.started_at):
        models.setdefault(w.served_model_name, ModelObject(id=w.served_model_name, created=int(w.started_at),
                                                           root=w.model, parent=w.parent))
    for name in settings.models:
        models.setdefault(name, ModelObject(id=name, created=0, root=None,
                                            parent=settings.adapter_parents.get(name)))
    return sorted(models.values(), key=lambda m: m.id)
