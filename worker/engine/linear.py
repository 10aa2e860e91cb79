"""Linear layers whose weights may be fused from several checkpoint tensors (q/k/v, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W the row-wise concatenation of `out_sizes` checkpoint tensors.

    `method` does the multiplication: Dense here, or a quantized method (quantization.py) that replaced the weight.
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
