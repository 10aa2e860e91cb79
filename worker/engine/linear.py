"""Linear layers whose weights may be fused from several checkpoint tensors (q/k/v, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W the row-wise concatenation of `out_sizes` checkpoint tensors.

    `method` does the multiplication: Dense here, PackedFloat32 (below) on CPU, or a quantized method
    (quantization.py); the last two replace the weight by their own form of it.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(out_sizes)), requires_grad=False) if bias else None
        self.method = DENSE

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.method.apply(self, x.reshape(-1, shape[-1])).reshape(*shape[:-1], -1)


class Dense:
    """The float weight as loaded."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = Dense()


def take_weight(layer: Linear) -> torch.Tensor:
    """Remove the float weight from a layer whose method replaces it with its own form."""
    w = layer.weight.data
    del layer.weight
    return w


def can_pack_float32(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class PackedFloat32:
    """A float32 CPU weight in MKL's packed GEMM layout, packed once at load.

    A plain sgemm repacks the whole weight on every call; with few rows (decode steps) that repacking costs as much
    as the multiplication, so packing once makes 4-64-row matmuls 1.4-1.7x faster (bench/throughput.py). The packed
    form replaces the weight: resident memory stays the same.
    """

    def __init__(self, layer: Linear):
        w = take_weight(layer)
        # the buffer's extent is MKL's; its pages are the weight's size when touched (it reserves more than it fills)
        self.nbytes = w.numel() * w.element_size()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
        # _mkl_linear takes the original weight only for its shape (and a fallback we never use): a 0-byte stand-in
        self.shape = torch.zeros((), dtype=w.dtype).expand(w.shape)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # the packed layout does not depend on the row count; passing this call's rows selects the packed kernel
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape, layer.bias, x.shape[0])


PACK_ROWS = 64  # MKL's row-count hint when packing: a decode step's size
