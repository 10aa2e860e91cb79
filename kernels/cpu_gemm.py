"""sluice's CPU GEMM (csrc/gemm_cpu.cpp): y = x W^T + b with W packed once into 32-column panels, in bfloat16 on
AVX512-BF16 (float32 sums) and float32 on AVX-512; a gated MLP's gate_up weight can also come out as
silu(gate) * up in the same pass. F.linear (and silu_and_mul after it) is its reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.kernels.cpu_build import build

PANEL = 32  # output columns per packed panel
PLAIN, GATED, SILU = 0, 1, 2  # the kernel's output modes (csrc/gemm_cpu.cpp)


def _extension():
    # no FMA contraction: the SiLU epilogue rounds as csrc/layers_cpu.cpp's silu_and_mul (built so) does
    return build("gemm_cpu.cpp", ("-ffp-contract=off",))


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes this CPU's build multiplies: bfloat16 where the compiler targets AVX512-BF16, float32 where it
    targets AVX-512; none where it could not be built."""
    ext = _extension()
    if ext is None:
        return ()
    return ((torch.bfloat16,) if ext.bf16 else ()) + ((torch.float32,) if ext.f32 else ())


def supports(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can be packed: a CPU tensor of a dtype in dtypes(), with K even for bfloat16 (the
    kernel takes x's columns in pairs)."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in dtypes()
            and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0))


def can_gate(weight: torch.Tensor) -> bool:
    """Whether a [gate; up] weight [2I, K] packs gated: I a multiple of 16 (a panel holds 16 of each)."""
    return weight.shape[0] % PANEL == 0


@dataclass
class PackedWeight:
    panels: torch.Tensor  # bfloat16 [ceil(N/32), K/2, 32, 2] or float32 [ceil(N/32), K, 32]
    out_features: int
    in_features: int
    bias: torch.Tensor | None  # float32 [ceil(N/32) * 32] in the panels' row order, zero-padded
    gated: bool  # rows ordered as 16 of gate then the 16 of up that pair with them, panel by panel

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def _gated_order(n: int) -> torch.Tensor:
    """Row order of a gated pack of [gate; up] with n rows: gate 0-15, up 0-15, gate 16-31, up 16-31, ..."""
    half = n // 2
    gate = torch.arange(half).view(-1, PANEL // 2)
    return torch.stack([gate, gate + half], 1).reshape(-1)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> PackedWeight:
    """The weight [N, K] (with its bias [N]) as panels; gated: a [gate; up] weight (can_gate) for silu_and_mul."""
    if not supports(weight) or (gated and not can_gate(weight)):
        raise ValueError(f"cpu_gemm.pack: a CPU weight [N, K] of {dtypes()} (K even for bfloat16; N a multiple of 32 "
                         f"when gated), got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    if gated:
        order = _gated_order(n)
        weight, bias = weight[order], bias[order] if bias is not None else None
    panels = -(-n // PANEL)
    w = F.pad(weight, (0, 0, 0, panels * PANEL - n))
    if weight.dtype == torch.bfloat16:
        w = w.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3)
    else:
        w = w.view(panels, PANEL, k).permute(0, 2, 1)
    if bias is not None:
        bias = F.pad(bias.float(), (0, panels * PANEL - n))
    return PackedWeight(w.contiguous(), n, k, bias, gated)


def _check(x: torch.Tensor, w: PackedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != w.panels.dtype or x.device.type != "cpu":
        raise ValueError(f"cpu_gemm: x must be a CPU [M, {w.in_features}] {w.panels.dtype} tensor, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")


def linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] of the weight's dtype -> x W^T + b [M, N], in the weight's own row order however it is packed."""
    _check(x, w)
    return _extension().linear(x.contiguous(), w.panels, w.out_features, w.bias, GATED if w.gated else PLAIN)


def linear_silu_and_mul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """silu(gate) * up of x [gate; up]^T + b for a gated pack: [M, N / 2], as silu_and_mul(linear(x, w))."""
    _check(x, w)
    if not w.gated:
        raise ValueError("cpu_gemm.linear_silu_and_mul: the weight was not packed gated")
    return _extension().linear(x.contiguous(), w.panels, w.out_features, w.bias, SILU)
