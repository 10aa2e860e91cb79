"""sluice: self-hosted batch LLM inference.

`from sluice import LLM, SamplingParams` is the engine; `from sluice import Client` the REST client. The names load
on first use, so `import sluice` and the client never import torch (an API host or a pipeline has none).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "sluice.worker.engine",
    "SamplingParams": "sluice.worker.engine",
    "RequestOutput": "sluice.worker.engine",
    "LoRARequest": "sluice.worker.engine",
    "Client": "sluice.api.client",
    "SluiceError": "sluice.api.client",
}
__all__ = ["LLM", "Client", "LoRARequest", "RequestOutput", "SamplingParams", "SluiceError"]

if TYPE_CHECKING:
    from sluice.api.client import Client, SluiceError
    from sluice.worker.engine import LLM, LoRARequest, RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
