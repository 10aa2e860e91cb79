"""`system_fingerprint`: names the configuration that produced a result (OpenAI's field), the same on every worker.

It hashes sluice's version, the weights' identity, dtype, quantization, KV-cache dtype and the LoRA adapter if any.
The weights' identity is a hash of each safetensors file's name, size and JSON header (tensor names, dtypes, shapes,
offsets): a few kilobytes read however large the checkpoint, and never its directory, so a copy elsewhere matches.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sluice
from sluice.worker.adapters import ServedModels
from sluice.worker.engine import LLMEngine, LoRARequest
from sluice.worker.engine.loader import safetensors_files
from sluice.worker.engine.lora import CONFIG_FILE

PREFIX, DIGITS = "fp_", 12
# adapter_config.json names the base model by the path it was trained from: not the adapter's identity
PATH_KEYS = ("base_model_name_or_path",)


def weights_identity(files: list[Path]) -> str:
    """A hash of each file's name, size and safetensors header (its tensors' names, dtypes, shapes, offsets)."""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
            header = f.read(min(length, max(size - 8, 0)))
        digest.update(json.dumps([file.name, size, len(header)]).encode())
        digest.update(header)
    return digest.hexdigest()


def adapter_identity(path: Path) -> str:
    """An adapter directory's weights identity and its config (rank, alpha, targets: they change its outputs)."""
    config = json.loads((path / CONFIG_FILE).read_text())
    kept = {k: v for k, v in config.items() if k not in PATH_KEYS}
    return hashlib.sha256(json.dumps([weights_identity(sorted(path.glob("*.safetensors"))), kept],
                                     sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What a result's system_fingerprint is derived from, for the base model; an adapter's identity is added."""

    weights: str  # weights_identity of the checkpoint, or "dummy" for drawn weights
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    version: str = sluice.__version__

    def value(self, adapter: str | None = None) -> str:
        """"fp_" and 12 hex digits, over every part and the adapter's identity (None: the base model)."""
        parts = json.dumps([asdict(self), adapter], sort_keys=True).encode()
        return PREFIX + hashlib.sha256(parts).hexdigest()[:DIGITS]


def engine_fingerprint(engine: LLMEngine) -> Fingerprint:
    """The engine's fingerprint parts, as it loaded and holds its weights."""
    config, runner = engine.config, engine.runner
    weights = "dummy" if config.load_format == "dummy" else weights_identity(safetensors_files(engine.path))
    quantization = runner.quantization
    if config.quantization == "int4":  # quantized on load: its group size changes the weights too
        quantization += f"/g{config.quantization_group_size}"
    if config.quantization and config.quantize_lm_head:
        quantization += "+lm_head"
    dtype = str(runner.dtype).removeprefix("torch.")
    return Fingerprint(weights, dtype, quantization, "int8" if runner.kv_int8 else dtype)


@dataclass
class Fingerprints:
    """A worker's system_fingerprint by served name: its base model's, and each adapter's, computed on first use."""

    base: Fingerprint
    served: ServedModels
    values: dict[str, str] = field(default_factory=dict)

    def of(self, name: str) -> str:
        """The fingerprint of results served under `name` (as ServedModels.resolve gives it)."""
        if name not in self.values:  # two threads may both compute it: the same value
            lora: LoRARequest | None = self.served.loras.get(name)
            self.values[name] = self.base.value(None if lora is None else adapter_identity(Path(lora.lora_path)))
        return self.values[name]
