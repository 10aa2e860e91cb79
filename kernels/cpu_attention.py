"""Paged decode attention on the CPU for float32, bfloat16 and float16 caches (csrc/paged_decode_cpu.cpp; float32
arithmetic inside), compiled on first use with PyTorch's C++ extension loader; paged_decode_attention_ref
(kernels/decode_attention.py) is its reference."""

from __future__ import annotations

import torch

from sluice.kernels import cpu_build
from sluice.kernels.checks import check_decode_inputs
from sluice.kernels.cpu_build import build

HEAD_DIMS = (16, 32, 64, 96, 128, 256)


def _extension():
    return build("paged_decode_cpu.cpp")


def dtypes() -> tuple[torch.dtype, ...]:
    return cpu_build.dtypes(_extension())


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this step: query and cache of one dtype it takes on the CPU, a head_dim it is built
    for."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype and q.shape[-1] in HEAD_DIMS
            and q.shape[1] % k_cache.shape[2] == 0 and q.dtype in dtypes())


def available() -> bool:
    return _extension() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query token per sequence over its first context_lens keys (its last
    `sliding_window` of them, if given): q [seqs, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim].
    With `softcap`, the scores are softcap * tanh(scores / softcap) (Gemma 2)."""
    if not supports(q, k_cache) or v_cache.dtype != q.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention_cpu: CPU tensors of one dtype of {dtypes()} with head_dim in "
                         f"{HEAD_DIMS} only, got q "
                         f"{q.dtype} {tuple(q.shape)} on {q.device}, caches {k_cache.dtype} {tuple(k_cache.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("paged_decode_attention_cpu: block_tables and context_lens must be int32")
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, None, None)
    ext = _extension()
    if ext is None:
        raise RuntimeError("the CPU decode attention kernel could not be built; see the warning logged above")
    out = torch.empty_like(q) if out is None else out
    result = out if out.is_contiguous() else torch.empty_like(q)
    ext.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_tables.contiguous(),
                     context_lens.contiguous(), scale, sliding_window or 0, softcap or 0.0, result)
    if result is not out:
        out.copy_(result)
    return out
