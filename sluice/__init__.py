"""sluice: self-hosted batch LLM inference.

`from sluice import LLM, SamplingParams` is the engine; `from sluice import Client` the REST client. The names load
on first use, so `import sluice` and the client never import torch (an API host or a pipeline has none).
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# A CPU engine's OpenMP threads that finish their share of a parallel region spin before they sleep: libgomp's
# default of 300,000 spins holds the CPU that a descheduled sibling needs to finish the region, so on a host whose
# cores other processes also use (the worker's Python, Postgres, clients) every region waits out a time slice. With
# two busy processes beside it on 2 cores the bench workload ran 4.7x slower than quiet at the default and 2.6x at
# 10,000 spins, which cost nothing quiet; at 100 quiet runs lost 15% (bench/NOTES.md). libgomp reads it once, when
# torch loads it: set here, before sluice imports torch; an explicit setting wins.
OPENMP_SPIN_DEFAULT = "10000"
if "GOMP_SPINCOUNT" not in os.environ and "torch" not in sys.modules:
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_DEFAULT
OPENMP_SPIN = os.environ.get("GOMP_SPINCOUNT")  # None: torch loaded libgomp, with its default, before sluice

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
