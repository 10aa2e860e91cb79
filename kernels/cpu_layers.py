"""The decoder's element-wise layers for float32, bfloat16 and float16 on the CPU (csrc/layers_cpu.cpp): RMSNorm with
its residual add, SiLU-and-mul and rotary embedding, one pass each where PyTorch takes three to five ops, computing in
float32 and rounding where PyTorch's forms round. Their references are the PyTorch forms in worker/engine/layers.py,
which serve every other device and dtype."""

from __future__ import annotations

import torch

from sluice.kernels import cpu_build
from sluice.kernels.cpu_build import build


def _extension():
    return build("layers_cpu.cpp", ("-ffp-contract=off",))  # no FMAs: rotary rounds as transformers' does


def available() -> bool:
    """Whether the kernels are built (building them now if not: a compile, once per machine)."""
    return _extension() is not None


def dtypes() -> tuple[torch.dtype, ...]:
    return cpu_build.dtypes(_extension())


def takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype go to the kernels: float32, bfloat16 and float16 on the CPU, where
    they could be built (building them on the first call)."""
    return device.type == "cpu" and dtype in dtypes()


def _check_rows(name: str, t: torch.Tensor, rows: int, width: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, width) or (width > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: expected [{rows}, {width}] with unit column stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")
    want = dtype or t.dtype
    if t.dtype != want or want not in dtypes() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected {', '.join(str(d) for d in dtypes())} on the CPU"
                         + (f" (that of x, {dtype})" if dtype else "") + f", got {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over x [rows, d]; with `residual`, of residual + x, written into
    `residual` in place first (a decoder layer's residual stream)."""
    rows, d = x.shape
    _check_rows("rms_norm x", x, rows, d)
    _check_rows("rms_norm weight", weight.view(1, -1), 1, d, x.dtype)
    if residual is not None:
        _check_rows("rms_norm residual", residual, rows, d, x.dtype)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _extension().rms_norm(x, residual, weight.contiguous(), eps, out)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [rows, 2d] holding gate then up: [rows, d]."""
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: the width {width} is odd, not gate and up side by side")
    _check_rows("silu_and_mul x", x, rows, width)
    out = x.new_empty(rows, width // 2)
    _extension().silu_and_mul(x, out)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated in place, token t by row positions[t] of the [max_positions, head_dim]
    cos and sin tables (whose halves are equal, as RotaryEmbedding builds them); returns x."""
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(2) != 1 or x.dtype not in dtypes() or x.device.type != "cpu":
        raise ValueError(f"rotary_: expected CPU x of {', '.join(str(d) for d in dtypes())} with an even head_dim "
                         f"of unit stride, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    for name, table in (("cos", cos), ("sin", sin)):  # the float32 tables, whatever x's dtype
        _check_rows(f"rotary_ {name}", table, cos.shape[0], dim, torch.float32)
    if positions.shape != (tokens,) or positions.dtype != torch.int64:
        raise ValueError(f"rotary_: positions must be int64 [{tokens}], got {positions.dtype} {tuple(positions.shape)}")
    _extension().rotary(x, positions.contiguous(), cos, sin)
    return x
