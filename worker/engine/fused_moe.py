"""Mixture-of-experts feed-forward: top-k routing, then the experts as one grouped computation.

Every (token, choice) slot is sorted by its expert, so each expert multiplies one contiguous run of rows: on CUDA the
Triton kernel (kernels/fused_moe.py) runs all experts in one launch for gate/up and one for down; on the CPU
torch._grouped_mm does (one GEMM per expert where PyTorch lacks it). The outputs go back to slot order and each
token sums its choices, weighted by the router.

INT8/INT4 expert weights (quantized by the loader tensor by tensor as they arrive: quantize_on_load, load_rows; or
from float weights by quantize, called by quantization.quantize_model): with the triton backend INT8 is
dequantized inside the kernel and INT4 dequantized per call into the model dtype; with the torch backend each expert
that has rows is dequantized and multiplied in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.quant import INT4_GROUP_SIZES, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from sluice.worker.engine.layers import silu_and_mul

GROUPED_MM = hasattr(torch, "_grouped_mm")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids [T, top_k]): softmax over every expert in float32, the top_k, and
    renormalised over them if asked (Mixtral always, which equals a softmax of the top-k logits; Qwen3-MoE when
    norm_topk_prob). A token's choices come in ascending expert order, the order transformers adds them in."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@dataclass
class SortedSlots:
    rows: torch.Tensor  # the token of each slot, in expert order
    order: torch.Tensor  # the slot (token * top_k + choice) of each sorted row
    counts: torch.Tensor  # rows per expert


def sort_slots(ids: torch.Tensor, num_experts: int) -> SortedSlots:
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    return SortedSlots(order // ids.shape[1], order, torch.bincount(flat, minlength=num_experts))


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [rows, K] sorted by expert, w [E, N, K], counts [E] -> [rows, N]: each expert's rows times its weight."""
    if GROUPED_MM:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    return looped_gemm(x, counts, lambda e: w[e])


def looped_gemm(x: torch.Tensor, counts: torch.Tensor, weight: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """One GEMM per expert that has rows, its weight [N, K] given by weight(e) (dequantized there if need be)."""
    out, start = None, 0
    for e, n in enumerate(counts.tolist()):
        if n:
            y = F.linear(x[start:start + n], weight(e))
            out = x.new_empty(x.shape[0], y.shape[1]) if out is None else out
            out[start:start + n] = y
            start += n
    return out


def combine(y: torch.Tensor, s: SortedSlots, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sorted rows [slots, H] back to slot order, weighted, and summed over each token's choices."""
    slots = torch.empty_like(y)
    slots[s.order] = y
    t, top_k = weights.shape
    return (slots.view(t, top_k, -1) * weights[..., None]).to(dtype).sum(1)


class FusedExperts(nn.Module):
    """num_experts SiLU-gated MLPs stacked: w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I].

    Each is held as its rows [E * N, K], so every checkpoint tensor (one expert's gate, up or down) is a slice of
    rows of one parameter, as the loader places a fused projection's shards."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size), requires_grad=False)
        self.mode: str | None = None  # None (float), "int8" or "int4"
        self.backend = "torch"
        self.group_size = 0

    def checkpoint_tensors(self, prefix: str, names: tuple[str, str, str]) -> dict[str, tuple[torch.Tensor, slice]]:
        """Per-expert checkpoint tensors (prefix.E.gate.weight, .up, .down, with the model's own names) -> rows."""
        gate, up, down = names
        i, h = self.intermediate_size, self.hidden_size
        out = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.{gate}.weight"] = (self.w13, slice(2 * i * e, 2 * i * e + i))
            out[f"{prefix}.{e}.{up}.weight"] = (self.w13, slice(2 * i * e + i, 2 * i * (e + 1)))
            out[f"{prefix}.{e}.{down}.weight"] = (self.w2, slice(h * e, h * (e + 1)))
        return out

    def stacked(self, name: str) -> torch.Tensor:
        """w13 [E, 2I, H] or w2 [E, H, I] as a view of its rows."""
        w = getattr(self, name)
        return w.view(self.num_experts, -1, w.shape[-1])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(x.shape)
        if (self.mode is None and x.is_cuda) or self.backend == "triton":
            return self._fused(x, weights, ids)
        s = sort_slots(ids, self.num_experts)
        if self.mode is None:
            h = silu_and_mul(grouped_gemm(x[s.rows], self.stacked("w13"), s.counts))
            return combine(grouped_gemm(h, self.stacked("w2"), s.counts), s, weights, x.dtype)
        h = silu_and_mul(looped_gemm(x[s.rows], s.counts, lambda e: self.dequantized("w13", e).to(x.dtype)))
        y = looped_gemm(h, s.counts, lambda e: self.dequantized("w2", e).to(x.dtype))
        return combine(y, s, weights, x.dtype)

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from sluice.kernels.fused_moe import fused_moe

        if self.mode is None:
            return fused_moe(x, self.stacked("w13"), self.stacked("w2"), weights, ids)
        if self.mode == "int8":
            return fused_moe(x, self.w13_qweight, self.w2_qweight, weights, ids, self.w13_scale, self.w2_scale)
        w13, w2 = (self.dequantized(name).to(x.dtype) for name in ("w13", "w2"))
        return fused_moe(x, w13, w2, weights, ids)

    def dequantized(self, name: str, expert: int | slice = slice(None)) -> torch.Tensor:
        """One expert's (or every expert's) weight from its INT8/INT4 form."""
        q = getattr(self, f"{name}_qweight")[expert]
        if self.mode == "int8":
            return dequantize_int8(q.flatten(0, -2), getattr(self, f"{name}_scale")[expert].flatten()).view(q.shape)
        scales, zeros = (getattr(self, f"{name}_{part}")[expert] for part in ("scales", "zeros"))
        w = dequantize_int4(q.flatten(0, -2), scales.flatten(0, -2), zeros.flatten(0, -2), self.group_size)
        return w.view(*q.shape[:-1], -1)

    @torch.no_grad()
    def quantize(self, mode: str, group_size: int, backend: str) -> None:
        """Replace w13 and w2 by INT8 (per output channel) or INT4 (per group along the input) forms, expert by
        expert into quantize_on_load's buffers: one expert's quantized temporaries exist at a time."""
        if self.mode is not None:
            return
        floats = {name: self.stacked(name).data for name in ("w13", "w2")}
        self.quantize_on_load(mode, group_size, backend, self.w13.device)
        for name, w in floats.items():
            n = w.shape[1]
            for e in range(w.shape[0]):
                parts = quantize_int8(w[e]) if mode == "int8" else quantize_int4(w[e], group_size)
                self.load_rows(name, slice(e * n, (e + 1) * n), parts)

    def quantize_on_load(self, mode: str, group_size: int, backend: str, device: torch.device) -> None:
        """Empty INT8/INT4 buffers on `device` in place of w13 and w2 (which the loader leaves on the meta device):
        load_rows then fills them tensor by tensor, so the float experts never exist in full."""
        for name in ("w13", "w2"):
            dtype = getattr(self, name).dtype
            e, n, k = self.stacked(name).shape
            _check_group_size(name, k, mode, group_size)
            shapes = ({"qweight": ((e, n, k), torch.int8), "scale": ((e, n), dtype)} if mode == "int8" else
                      {"qweight": ((e, n, k // 2), torch.uint8), "scales": ((e, n, k // group_size), dtype),
                       "zeros": ((e, n, k // group_size), dtype)})
            delattr(self, name)
            for suffix, (shape, dtype) in shapes.items():
                self.register_buffer(f"{name}_{suffix}", torch.empty(shape, dtype=dtype, device=device))
        self.mode, self.group_size, self.backend = mode, group_size, backend

    def load_rows(self, name: str, rows: slice, buffers: tuple[torch.Tensor, ...]) -> None:
        """One tensor's quantized buffers (an expert's gate, up or down: rows of w13 or w2, as checkpoint_tensors
        gives them) into those rows, in quantize_on_load's order. Rows quantize on their own: the same bytes as the
        whole expert's."""
        suffixes = ("qweight", "scale") if self.mode == "int8" else ("qweight", "scales", "zeros")
        for suffix, part in zip(suffixes, buffers, strict=True):
            getattr(self, f"{name}_{suffix}").flatten(0, 1)[rows].copy_(part)


def _check_group_size(name: str, in_features: int, mode: str, group_size: int) -> None:
    if mode == "int4" and (group_size not in INT4_GROUP_SIZES or in_features % group_size):
        raise ValueError(f"experts.{name}: in_features {in_features} is not a multiple of int4 group_size "
                         f"{group_size}; choose one of {INT4_GROUP_SIZES} that divides it")
