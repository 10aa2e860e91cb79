"""Linear layers whose weights may be fused from several checkpoint tensors (q/k/v, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import cpu_gemm as sluice_gemm


class Linear(nn.Module):
    """y = x W^T + b, with W the row-wise concatenation of `out_sizes` checkpoint tensors.

    `method` does the multiplication: Dense here, a packed float32 method on CPU (PackedMklFloat32 or
    PackedOneDnnFloat32, below), or a quantized method (quantization.py); the last two replace the weight by their own
    form of it.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.out_features = sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.method = DENSE

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    lora = None  # the adapters' updates of this projection (lora_layers.LoRALayer) when the engine serves LoRA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        y = self.method.apply(self, x)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        # the output's width named, not inferred: a step that samples nothing gives the last layer's o_proj no rows
        return y.reshape(*shape[:-1], self.out_features)


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


def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies bfloat16 (float16) natively, which oneDNN's GEMM then uses: AVX512-BF16 or AMX
    tiles (AMX-FP16 for float16). Without, oneDNN would convert every tile to float32 first."""
    import torch.cpu as cpu

    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or amx()
    return dtype == torch.float16 and cpu._is_amx_fp16_supported()


def amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bfloat16 GEMM uses."""
    import torch.cpu as cpu

    return cpu._is_amx_tile_supported()


def can_pack_half(weight: torch.Tensor) -> bool:
    """A bfloat16 or float16 CPU weight oneDNN can hold pre-blocked and multiply natively (PackedOneDnnFloat32 takes
    these dtypes too; accumulation stays float32 inside oneDNN)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and native_half_gemm(weight.dtype))


def can_pack_mkl(weight: torch.Tensor) -> bool:
    return can_pack_float32(weight) and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def cpu_vendor() -> str:
    """The CPU's vendor string ('GenuineIntel', 'AuthenticAMD'), or '' where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def cpu_gemm(choice: str, dtype: torch.dtype = torch.float32) -> str:
    """Which GEMM runs the CPU projections of `dtype`: 'sluice', 'mkl' or 'onednn'.

    'auto' takes sluice's own (kernels/cpu_gemm.py) for bfloat16 where it is built for AVX512-BF16 and the CPU has no
    AMX tiles: at a decode step's rows it outran oneDNN's on the same weights, but oneDNN multiplies on AMX tiles
    where they exist, which sluice's kernel does not use. For float32 it ran no faster than oneDNN's in the engine, so
    'auto' keeps MKL's packed sgemm on Intel CPUs and oneDNN's elsewhere: MKL dispatches by vendor and takes a generic
    path on AMD CPUs, where oneDNN (which dispatches by instruction set) ran faster; on an Intel Xeon MKL's packed
    kernel ran faster than oneDNN's from 4 to 256 rows (bench/throughput.py prints both rates; bench/NOTES.md has the
    runs). MKL has no bfloat16 path: 'mkl' means oneDNN's there."""
    wanted = choice == "sluice" or (choice == "auto" and dtype == torch.bfloat16 and not amx())
    ours = wanted and dtype in sluice_gemm.dtypes()  # builds the kernel (once a machine) only where it may be chosen
    if choice == "sluice" and not ours:
        raise ValueError(f"cpu_gemm='sluice' needs its {dtype} kernel, which this CPU's build lacks (bfloat16 needs "
                         "AVX512-BF16, float32 AVX-512, and both a C++ compiler)")
    mkl = can_pack_mkl(torch.empty(1))
    if choice == "mkl" and not mkl:
        raise ValueError("cpu_gemm='mkl' needs a PyTorch built with MKL and oneDNN")
    if ours:
        return "sluice"
    if dtype != torch.float32:
        return "onednn"
    if choice != "auto":
        return choice
    return "mkl" if mkl and cpu_vendor() == "GenuineIntel" else "onednn"


EXACT_ROWS = 64  # bucket_rows keeps row counts up to this: a decode step's size


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN GEMM runs at: up to EXACT_ROWS rows as they are, then rounded up to a multiple of 8
    up to 256, then to one of 16 sizes per doubling (at most 6.25% padding).

    oneDNN builds a primitive for every new row count (costing more than running one) and caches 1024 of them: a
    worker whose prefill steps take any token count
    up to max_num_batched_tokens would build one per projection nearly every step. With 152 sizes up to 4096 rows
    every projection's primitives stay cached. Decode steps of up to 64 sequences stay exact: padding them to a
    multiple of 8 computed 9% more rows on average, and a decode step is all GEMM.
    """
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(3, (rows - 1).bit_length() - 5)
    return -(-rows // step) * step


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


class PackedOneDnnFloat32:
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


class PackedSluiceGemm:
    """A CPU weight in sluice's own GEMM's panels (kernels/cpu_gemm.py), packed once at load; replaces the weight.
    At a decode step's 8-64 rows it runs 1.0-2.4x oneDNN's bfloat16 GEMM on the same weights, 0.95-1.08x at 2048
    (bench/NOTES.md); no primitive per row count, so no row bucketing. A [gate; up] projection packs gated, so a
    SiLU MLP can take silu(gate) * up straight from the GEMM (fused_silu_and_mul)."""

    def __init__(self, layer: Linear):
        sizes = layer.out_sizes
        gated = len(sizes) == 2 and sizes[0] == sizes[1] and sluice_gemm.can_gate(layer.weight)
        self.packed = sluice_gemm.pack(take_weight(layer), layer.bias, gated)
        self.nbytes = self.packed.nbytes

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return sluice_gemm.linear(x, self.packed)

    def fused_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this [gate; up] projection in one pass, or None where it is not packed so."""
        return sluice_gemm.linear_silu_and_mul(x, self.packed) if self.packed.gated else None


class OneDnnFloat32:
    """oneDNN's GEMM on the weight as loaded: for a weight another module shares (a tied lm_head), which packing
    would have to copy."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, layer.weight, layer.bias)


class PackedMklFloat32:
    """A float32 CPU weight in MKL's packed sgemm layout (cblas_sgemm_pack), packed once at load.

    The packed form does not depend on the row count: PyTorch's op takes the packed path only when told the row
    count the weight was packed for (and multiplies the original weight otherwise), so every call passes its own.
    The op reads only the original weight's shape and dtype, so a stride-0 stand-in keeps memory as it was. No
    primitive is built per row count, so unlike oneDNN's GEMM no row bucketing is needed.
    """

    def __init__(self, layer: Linear):
        w = take_weight(layer)
        self.nbytes = w.numel() * w.element_size()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
        self.shape = w.new_empty(1).expand(w.shape)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape, layer.bias, x.shape[0])


ONEDNN_FLOAT32 = OneDnnFloat32()
PACKED_FLOAT32 = {"onednn": PackedOneDnnFloat32, "mkl": PackedMklFloat32}  # by cpu_gemm's answer
# the row count a weight is packed for: a decode step's size (oneDNN runs 8-64 rows near peak with it; MKL's pack
# serves every row count, see PackedMklFloat32)
PACK_ROWS = 64
