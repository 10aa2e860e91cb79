"""The API server's limits and options, read once from the environment (or given directly, as tests do).

SLUICE_MAX_FILE_BYTES   largest upload (default 200 MB, OpenAI's limit for batch files)
SLUICE_MAX_BATCH_LINES  most requests in one batch file (default 50,000, OpenAI's)
SLUICE_MODELS           served model names accepted before any worker serving them is up, comma-separated
SLUICE_METRICS_TOKEN    when set, GET /metrics needs `Authorization: Bearer <it>`; unset, /metrics is open as
                        Prometheus scrapes usually are (it shows counts per model, never request content)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from sluice.api.store import MAX_FILE_BYTES, MAX_LINES


@dataclass(frozen=True)
class Settings:
    max_file_bytes: int = MAX_FILE_BYTES
    max_batch_lines: int = MAX_LINES
    models: tuple[str, ...] = ()
    # LoRA adapters among `models`, each with the base model it runs on (`sluice serve --lora`): batches may mix them
    adapter_parents: dict[str, str] = field(default_factory=dict)
    metrics_token: str | None = None

    @classmethod
    def from_env(cls) -> Settings:
        models = tuple(name.strip() for name in os.environ.get("SLUICE_MODELS", "").split(",") if name.strip())
        return cls(max_file_bytes=_positive("SLUICE_MAX_FILE_BYTES", MAX_FILE_BYTES),
                   max_batch_lines=_positive("SLUICE_MAX_BATCH_LINES", MAX_LINES), models=models,
                   metrics_token=os.environ.get("SLUICE_METRICS_TOKEN") or None)


def _positive(name: str, default: int) -> int:
    raw = os.environ.get(name) or str(default)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: give a whole number, at least 1")
    return int(raw)
