"""LoRA adapters in PEFT's format: a request's choice of adapter, and one adapter read from disk and checked against
the base model's projections (by shapes: the base model an adapter names is only a hint, adapters move between
machines)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from sluice.worker.engine.config import ModelError
from sluice.worker.engine.linear import Linear

# the checkpoint's projection names a fused Linear is built from (models/llama.py's FUSED, by fused module)
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?:embedding_)?(?P<kind>[AB])(?:\.[^.]+)?(?:\.weight)?")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's LoRARequest): its served name, a positive id and its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")


@dataclass
class LoRAModule:
    """One projection's low-rank update: delta = (x @ a.T) @ b.T, with the scaling folded into b.
    For a fused Linear (q/k/v, gate/up) `a` stacks the targeted shards' A matrices and `b` is block-diagonal: each
    shard's B maps its own rank columns to its own output rows (zeros elsewhere), so one product serves every shard
    (two small matmuls a group of rows instead of one per shard: a CPU step of many adapters is bound by op count)."""

    a: torch.Tensor  # [sum of the shards' ranks, in_features]
    b: torch.Tensor  # [out_features, sum of the shards' ranks]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of any module (rank_pattern may vary it)
    modules: dict[str, LoRAModule] = field(default_factory=dict)  # by the engine's Linear module name

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def lora_targets(model: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Checkpoint module name (as PEFT names it) -> (the engine's Linear name, shard index or None for all rows)."""
    targets: dict[str, tuple[str, int | None]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.rsplit(".", 1)[-1] not in TARGETS:
            continue
        targets[name] = (name, None)  # a checkpoint that stores the fused projection (Phi-3) targets it whole
        prefix, leaf = name.rsplit(".", 1)
        for shard, proj in enumerate(SHARDS.get(leaf, ())):
            targets[f"{prefix}.{proj}"] = (name, shard)
    return targets


def load_adapter(name: str, path: str | Path, model: torch.nn.Module, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check one PEFT LoRA adapter directory; ModelError naming the adapter and the problem."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ModelError(f"adapter {name!r}: {path / CONFIG_FILE} not found (a PEFT LoRA adapter directory holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"adapter {name!r}: {path / CONFIG_FILE} is unreadable: {e}") from None
    _check_config(name, config)
    tensors = _read_tensors(name, path / WEIGHTS_FILE)
    targets = lora_targets(model)
    linears = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        m = _TENSOR.fullmatch(key.removeprefix(_PEFT_PREFIX))
        if m is None:
            others.append(key)
        else:
            pairs.setdefault(m["module"], {})[m["kind"]] = tensor
    adapter = LoRAAdapter(name, path, rank=0)
    by_linear: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor, float]]] = {}
    for module, pair in sorted(pairs.items()):
        if module not in targets:
            leaf = module.rsplit(".", 1)[-1]
            raise ModelError(f"adapter {name!r}: target module {module} is not supported (LoRA applies to "
                             f"{', '.join(TARGETS[:7])}; {leaf} is not one of this model's projections)")
        if pair.keys() != {"A", "B"}:
            raise ModelError(f"adapter {name!r}: {module} has lora_{''.join(pair)} without its pair")
        linear_name, shard = targets[module]
        a, b = pair["A"], pair["B"]
        _check_shapes(name, module, a, b, linears[linear_name], shard, max_rank)
        adapter.rank = max(adapter.rank, a.shape[0])
        scale = _scaling(config, module, a.shape[0])
        by_linear.setdefault(linear_name, []).append((shard, a, b, scale))
    if others:
        raise ModelError(f"adapter {name!r}: tensor {others[0]} is not a LoRA A or B matrix (embedding, lm_head "
                         f"and bias adapters are not supported)")
    if not by_linear:
        raise ModelError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for linear_name, shards in by_linear.items():
        adapter.modules[linear_name] = _module(linears[linear_name], shards, dtype)
    return adapter


def _check_config(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not supported; only LORA")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)", "lora_bias": "lora_bias",
               "layer_replication": "layer_replication", "target_parameters": "target_parameters (expert weights)",
               "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
               "trainable_token_indices": "trainable_token_indices (embedding updates)"}
    for key, what in refused.items():
        if config.get(key):
            raise ModelError(f"adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ModelError(f"adapter {name!r}: bias={config['bias']!r} is not supported; only 'none'")
    if config.get("modules_to_save"):
        raise ModelError(f"adapter {name!r}: modules_to_save {config['modules_to_save']} is not supported (embedding "
                         f"and lm_head adapters are refused)")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), int | float):
        raise ModelError(f"adapter {name!r}: {CONFIG_FILE} needs an integer r and a numeric lora_alpha")


def _read_tensors(name: str, file: Path) -> dict[str, torch.Tensor]:
    if not file.exists():
        raise ModelError(f"adapter {name!r}: {file} not found")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own types for corrupt headers and data
        raise ModelError(f"adapter {name!r}: {file} is unreadable: {e}") from None


def _check_shapes(name: str, module: str, a: torch.Tensor, b: torch.Tensor, linear: Linear, shard: int | None,
                  max_rank: int) -> None:
    rank = a.shape[0]
    out = linear.out_features if shard is None else linear.out_sizes[shard]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features or b.shape != (out, rank):
        raise ModelError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base model's "
                         f"projection needs A [r, {linear.in_features}] and B [{out}, r] (an adapter for another "
                         f"base model?)")
    if rank > max_rank:
        raise ModelError(f"adapter {name!r}: {module} has rank {rank}, above max_lora_rank {max_rank}")


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's alpha / r (alpha / sqrt(r) with rsLoRA), alpha_pattern's alpha where a pattern names the module."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _module(linear: Linear, shards: list[tuple[int | None, torch.Tensor, torch.Tensor, float]],
            dtype: torch.dtype) -> LoRAModule:
    shards = sorted(shards, key=lambda s: -1 if s[0] is None else s[0])
    b_full = torch.zeros(linear.out_features, sum(a.shape[0] for _, a, _, _ in shards), dtype=dtype)
    col = 0
    for shard, a, b, scale in shards:
        rows = slice(0, linear.out_features) if shard is None else linear.shard_rows(shard)
        b_full[rows, col:col + a.shape[0]] = (b.float() * scale).to(dtype)
        col += a.shape[0]
    return LoRAModule(torch.cat([a.to(dtype) for _, a, _, _ in shards]), b_full)
