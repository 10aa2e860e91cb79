"""The names a worker serves: its base model's and its LoRA adapters', and which adapter a request's `model` picks."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.worker.engine import LoRARequest


class UnknownModel(ValueError):
    """A request names a model this worker does not serve."""


@dataclass(frozen=True)
class ServedModels:
    base: str  # the base model's served name
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # by served name

    @classmethod
    def of(cls, base: str, adapters: dict[str, str]) -> ServedModels:
        """From served name -> adapter directory; ids in the order given, so every process numbers them alike."""
        return cls(base, {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)})

    @property
    def names(self) -> list[str]:
        return [self.base, *self.loras]

    @property
    def adapters(self) -> dict[str, str]:
        """Served name -> adapter directory."""
        return {name: request.lora_path for name, request in self.loras.items()}

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The served name a request runs under and its adapter (None: the base model); no name is the base."""
        if name is None or name == self.base:
            return self.base, None
        if name not in self.loras:
            raise UnknownModel(f"model {name!r} is not served here (served: {', '.join(self.names)})")
        return name, self.loras[name]
