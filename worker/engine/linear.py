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
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedFloat32:
    """A float32 CPU weight in oneDNN's blocked GEMM layout, packed once at load.

    PyTorch's float32 matmul is MKL's sgemm, which on AMD CPUs takes a generic path and repacks the whole weight on
    every call: oneDNN picks its kernel by instruction set, not vendor, and with the weight pre-blocked a 64-row
    decode matmul runs about twice as fast (bench/throughput.py prints the engine's step rates). The packed form
    replaces the weight: resident memory stays the same.
    """

    def __init__(self, layer: Linear):
        w = take_weight(layer)
        self.nbytes = w.numel() * w.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.packed, layer.bias)


class OneDnnFloat32:
    """oneDNN's GEMM on the weight as loaded: for a weight another module shares (a tied lm_head), which packing
    would have to copy."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, layer.weight, layer.bias)


ONEDNN_FLOAT32 = OneDnnFloat32()
PACK_ROWS = 64  # oneDNN's row-count hint when blocking: a decode step's size (8-64 rows run at near peak with it)
