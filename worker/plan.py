"""`sluice plan`'s arithmetic: from config.json alone, the weights, the KV cache the engine would get in a GPU's
memory, and the sequences it holds at a workload's lengths."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from sluice.kernels.quant import INT4_GROUP_SIZES
from sluice.worker.engine.config import EngineConfig, ModelConfig
from sluice.worker.engine.fused_moe import FusedExperts
from sluice.worker.engine.loader import build_model
from sluice.worker.engine.memory import activation_bytes, kv_bytes_per_token, kv_cache_budget
from sluice.worker.engine.prequantized import checkpoint_quantization
from sluice.worker.engine.quantization import quantized_linears

GiB = 1 << 30
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
# recommendations stop at the engine's default cap: past it throughput has long flattened (`sluice bench sweep`)
DEFAULT_MAX_NUM_SEQS = EngineConfig.__dataclass_fields__["max_num_seqs"].default


def parse_size(text: str) -> int:
    """Bytes of '80GiB', '24GB', '1.5 TiB' or '123456' (decimal units are powers of 1000, binary ones of 1024)."""
    match = _SIZE.fullmatch(text)
    unit = match and UNITS.get(match[2].lower())
    if unit is None:
        raise ValueError(f"{text!r} is not a size: give bytes or a number with a unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB")
    return int(float(match[1]) * unit)


@dataclass(frozen=True)
class WorkloadLengths:
    """Each request's tokens at most: prompt plus max_tokens (one entry per sequence)."""

    lengths: list[int]
    source: str  # "max_model_len", "given" (--prompt-tokens, --output-tokens) or the input file
    skipped: int = 0  # input lines that would not run, left out

    @property
    def mean(self) -> float:
        return float(np.mean(self.lengths))

    @property
    def p95(self) -> int:
        return math.ceil(np.percentile(self.lengths, 95))


@dataclass
class Plan:
    model: str
    architecture: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    gpu_memory_bytes: int
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes_per_token: int
    fits: bool
    message: str | None  # why it does not fit
    workload: str  # WorkloadLengths.source
    num_sequences: int | None  # in the input file
    sequence_tokens_mean: float
    sequence_tokens_p95: int
    skipped_lines: int  # of the input file: invalid, or longer than max_model_len
    # None when it does not fit
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrent_sequences: int | None = None  # at the mean length; what memory holds, whatever max_num_seqs
    max_concurrent_sequences_p95: int | None = None
    recommended_max_num_seqs: int | None = None


def make_plan(model: str, c: ModelConfig, config: EngineConfig, max_model_len: int, gpu_memory: int,
              workload: WorkloadLengths) -> Plan:
    dtype = config.torch_dtype(c)
    kv_int8 = config.kv_cache_dtype == "int8"
    mode, group = weight_quantization(c, config)
    weights = weight_bytes(c, dtype, mode, group, config.quantize_lm_head)
    activations = activation_bytes(c, config.max_num_batched_tokens)
    per_token = kv_bytes_per_token(c, dtype, kv_int8)
    per_block = per_token * config.block_size
    budget = kv_cache_budget(gpu_memory - weights, activations)
    blocks = max(budget // per_block, 0)
    plan = Plan(model, c.architecture, str(dtype).removeprefix("torch."), mode, "int8" if kv_int8 else "auto",
                gpu_memory, max_model_len, config.block_size, config.max_num_batched_tokens, weights, activations,
                per_token, blocks >= 1, None, workload.source,
                len(workload.lengths) if workload.source not in ("max_model_len", "given") else None,
                workload.mean, workload.p95, workload.skipped)
    if not plan.fits:
        plan.message = _shortfall(weights, activations, gpu_memory, per_block, config.block_size)
        return plan
    plan.kv_cache_bytes, plan.kv_cache_tokens = blocks * per_block, blocks * config.block_size
    plan.max_concurrent_sequences = blocks // math.ceil(workload.mean / config.block_size)
    plan.max_concurrent_sequences_p95 = blocks // math.ceil(workload.p95 / config.block_size)
    plan.recommended_max_num_seqs = min(max(plan.max_concurrent_sequences_p95, 1), DEFAULT_MAX_NUM_SEQS)
    return plan


def _shortfall(weights: int, activations: int, gpu_memory: int, per_block: int, block_size: int) -> str:
    need = weights + activations
    if need >= gpu_memory:
        return (f"the weights ({weights / GiB:.2f} GiB) and activation headroom ({activations / GiB:.2f} GiB) need "
                f"{need / GiB:.2f} GiB, {(need - gpu_memory) / GiB:.2f} GiB more than the {gpu_memory / GiB:.2f} GiB "
                f"given")
    return (f"after the weights ({weights / GiB:.2f} GiB) and activation headroom ({activations / GiB:.2f} GiB), the "
            f"{gpu_memory / GiB:.2f} GiB given hold no {block_size}-token KV block ({per_block} bytes)")


def weight_quantization(c: ModelConfig, config: EngineConfig) -> tuple[str | None, int]:
    """The projections' format as the engine holds them: quantized on load, or a pre-quantized checkpoint's
    repacked (INT4 groups of 32, 64 or 128: the largest dividing the checkpoint's; per channel, 128)."""
    pre = checkpoint_quantization(c.raw)
    if pre is None:
        return config.quantization, config.quantization_group_size
    if config.quantization:
        raise ValueError(f"--quantization {config.quantization} quantizes a float checkpoint; this one is already "
                         f"quantized ({pre.label}): leave it out")
    if pre.bits == 8:
        return "int8", 0
    group = max(INT4_GROUP_SIZES) if pre.group_size == -1 else pre.group_size
    return "int4", max(g for g in INT4_GROUP_SIZES if group % g == 0)


def weight_bytes(c: ModelConfig, dtype: torch.dtype, mode: str | None, group_size: int,
                 quantize_lm_head: bool = False) -> int:
    """Bytes of the weights as the engine holds them, counted on the model built on the meta device (no memory):
    quantized projections with their scales (and zeros), everything else in the model dtype, tied tensors once."""
    model = build_model(c, None, 1, dtype, torch.device("meta"))
    quantized = set(quantized_linears(model, mode, group_size, quantize_lm_head)) if mode else set()
    total, seen = 0, set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            experts = bool(mode) and isinstance(module, FusedExperts)  # w13 and w2, quantized row by row too
            if experts or (module in quantized and name == "weight"):
                total += quantized_bytes(*param.shape, mode, group_size, dtype)
            else:
                total += param.numel() * dtype.itemsize
    return total


def quantized_bytes(rows: int, cols: int, mode: str, group_size: int, dtype: torch.dtype) -> int:
    """A [rows, cols] weight in kernels/quant.py's formats: INT8 with a scale per row, INT4 two to a byte with a
    scale and a zero per group of group_size along cols; scales and zeros in the model dtype."""
    if mode == "int8":
        return rows * cols + rows * dtype.itemsize
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of int4 group_size {group_size}; choose one of "
                         f"{INT4_GROUP_SIZES} that divides it")
    return rows * cols // 2 + 2 * rows * (cols // group_size) * dtype.itemsize
