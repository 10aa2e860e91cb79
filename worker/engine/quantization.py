"""Weight-only INT8/INT4 quantization of the attention and MLP projections, applied on load from float weights.

Each quantized layer keeps the packed weights as buffers and a method that multiplies by them: Triton kernels with
dequantization fused (CUDA), PyTorch's weight-only CPU kernels, or dequantize-then-matmul where neither applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.quant import (
    INT4_GROUP_SIZES,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from sluice.worker.engine.fused_moe import FusedExperts
from sluice.worker.engine.linear import DENSE, Linear, take_weight

QUANTIZATIONS = ("int8", "int4")
QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# PyTorch's CPU weight-only kernels are vectorized for bfloat16 activations (W8A16/W4A16: 16-bit activations) and
# cost time linear in the rows; the int8 one loses to dequantize + bfloat16 matmul past 16 rows (bench/quant_decode.py)
CPU_KERNEL_DTYPE = torch.bfloat16
CPU_INT8_MAX_ROWS = 16
# PyTorch's CPU int4 packing lays out blocks of 64 rows on their own: packed this many rows at a time it gives the same
# bytes, and its int32 input (8x the packed weight) stays small while loading
CPU_INT4_PACK_ROWS = 1024


def quantize_model(model: torch.nn.Module, mode: str, group_size: int, backend: str, lm_head: bool = False) -> None:
    """Replace the float weight of every attention/MLP projection (and lm_head if asked) by its quantized form."""
    # those the loader quantized as their tensors arrived (loader.py) are left as they are
    for module in quantized_linears(model, mode, group_size, lm_head):
        if isinstance(module, FusedExperts):  # their own weight layout: they quantize themselves
            module.quantize(mode, group_size, backend)
        elif module.method is DENSE:
            method = new_method(mode, group_size, backend)
            method.quantize(module)
            module.method = method


def quantized_linears(model: torch.nn.Module, mode: str, group_size: int,
                      lm_head: bool = False) -> list[Linear | FusedExperts]:
    """The projections `mode` quantizes, each checked against the group size before any weight is read, and the MoE
    experts (which the loader then quantizes as their tensors arrive, like the projections)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    layers = QUANTIZED_LAYERS + (("lm_head",) if lm_head else ())
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in layers:
            if mode == "int4" and module.in_features % group_size:
                raise ValueError(f"{name}: in_features {module.in_features} is not a multiple of int4 group_size "
                                 f"{group_size}; choose one of {INT4_GROUP_SIZES} that divides it")
            found.append(module)
        elif isinstance(module, FusedExperts):
            found.append(module)
    return found


def new_method(mode: str, group_size: int, backend: str) -> Int8Method | Int4Method:
    return Int8Method(backend) if mode == "int8" else Int4Method(backend, group_size)


def backend_is_cpu_torch(backend: str, w: torch.Tensor) -> bool:
    return backend == "torch" and w.device.type == "cpu"


class Int8Method:
    """Symmetric per-output-channel INT8; y = x @ (q * scale).T."""

    def __init__(self, backend: str):
        self.backend = backend

    def quantize(self, layer: Linear) -> None:
        self.load(layer, *self.quantize_rows(take_weight(layer)))

    @staticmethod
    def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The buffers of these weight rows: quantizing a fused weight's shards one by one gives the same bytes."""
        return quantize_int8(w)

    def load(self, layer: Linear, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """Take the layer's quantized weight (kernels/quant.py's format) in place of a float one."""
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scale", scale)
        self.on_cpu = backend_is_cpu_torch(self.backend, qweight)
        self.cpu_kernel = self.on_cpu and layer.in_features % 32 == 0  # its vectorized loop needs whole 32s
        if self.on_cpu:
            self.cpu_scale = scale.to(CPU_KERNEL_DTYPE)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from sluice.kernels.w8a16 import w8a16_matmul

            return _bias(w8a16_matmul(x, layer.qweight, layer.scale), layer)
        if not self.on_cpu:
            return F.linear(x, dequantize_int8(layer.qweight, layer.scale).to(x.dtype), layer.bias)
        # CPU: the weight-only kernel for few rows; past them a bfloat16 matmul beats it, dequantization included
        xb = x.to(CPU_KERNEL_DTYPE)
        if self.cpu_kernel and x.shape[0] <= CPU_INT8_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(xb, layer.qweight, self.cpu_scale)
        else:
            y = F.linear(xb, layer.qweight.to(CPU_KERNEL_DTYPE) * self.cpu_scale[:, None])
        return _bias(y.to(x.dtype), layer)


class Int4Method:
    """Group-wise asymmetric INT4 along the input dimension, two weights per byte."""

    def __init__(self, backend: str, group_size: int):
        self.backend, self.group_size = backend, group_size

    def quantize(self, layer: Linear) -> None:
        self.load(layer, *self.quantize_rows(take_weight(layer)))

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The buffers of these weight rows: quantizing a fused weight's shards one by one gives the same bytes."""
        return quantize_int4(w, self.group_size)

    def load(self, layer: Linear, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             perm: torch.Tensor | None = None) -> None:
        """Take the layer's quantized weight (kernels/quant.py's format) in place of a float one. `perm`: the input
        features in the order of the weight's columns (GPTQ's act-order), applied to x before every matmul."""
        self.permuted = perm is not None
        if self.permuted:
            layer.register_buffer("perm", perm)
        self.cpu_kernel = backend_is_cpu_torch(self.backend, qweight) and qweight.shape[0] % 16 == 0
        if self.cpu_kernel:  # keep only the CPU kernel's own packing (same bytes), not both
            packed = _cpu_int4_pack(qweight)
            layer.register_buffer("qweight", packed)
            layer.register_buffer("scales_and_zeros", torch.stack([scales.T, zeros.T], -1).to(CPU_KERNEL_DTYPE))
        else:
            layer.register_buffer("qweight", qweight)
            layer.register_buffer("scales", scales)
            layer.register_buffer("zeros", zeros)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.permuted:
            x = x.index_select(-1, layer.perm)
        if self.cpu_kernel:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(CPU_KERNEL_DTYPE), layer.qweight, self.group_size,
                                                           layer.scales_and_zeros)
            return _bias(y.to(x.dtype), layer)
        if self.backend == "triton":
            from sluice.kernels.w4a16 import w4a16_matmul

            return _bias(w4a16_matmul(x, layer.qweight, layer.scales, layer.zeros, self.group_size), layer)
        w = dequantize_int4(layer.qweight, layer.scales, layer.zeros, self.group_size)
        return F.linear(x, w.to(x.dtype), layer.bias)


def _cpu_int4_pack(qweight: torch.Tensor) -> torch.Tensor:
    chunks = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight[i:i + CPU_INT4_PACK_ROWS])
                                                                 .to(torch.int32), 1)
              for i in range(0, qweight.shape[0], CPU_INT4_PACK_ROWS)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _bias(y: torch.Tensor, layer: Linear) -> torch.Tensor:
    return y if layer.bias is None else y + layer.bias
