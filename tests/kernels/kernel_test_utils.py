"""Helpers for the kernel tests: tolerances, NaN-filled outputs, and paged KV caches behind shuffled block tables."""

import os

import torch

from sluice.kernels.quant import quantize_kv_int8

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"

# (atol, rtol) of a kernel against its float32 reference, by activation dtype: about 4 ulps of the output dtype
# at the outputs' scale (attention outputs are O(1); matmul outputs are rescaled by the tests to O(1)).
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def nan_like(shape, dtype: torch.dtype) -> torch.Tensor:
    """Output buffer that fails any comparison where the kernel forgot to write."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def make_paged_kv(gen, context_lens, block_size, num_kv_heads, head_dim, dtype, int8=False, spare_blocks=5):
    """Random K/V for each sequence in a paged cache whose blocks are handed out in shuffled order.

    Returns (k_cache, v_cache, k_scale, v_scale, block_tables); the scales are None unless int8.
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks  # spare blocks hold values no sequence may read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=DEVICE)
    v = torch.randn(shape, generator=gen, device=DEVICE)
    ids = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int32, device=DEVICE)
    start = 0
    for i, nb in enumerate(blocks_per_seq):  # rows padded with block 0 beyond the sequence's blocks
        block_tables[i, :nb] = ids[start : start + nb]
        start += nb
    if not int8:
        return k.to(dtype), v.to(dtype), None, None, block_tables
    (k, k_scale), (v, v_scale) = quantize_kv_int8(k), quantize_kv_int8(v)
    return k, v, k_scale, v_scale, block_tables


def gather_context(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """One sequence's first n cached tokens as contiguous float32 [n, kv_heads, dim], block by block."""
    blocks = [int(b) for b in block_table[: -(-n // cache.shape[1])]]
    rows = torch.cat([cache[b] for b in blocks])[:n].float()
    if scale is not None:
        rows = rows * torch.cat([scale[b] for b in blocks])[:n, :, None]
    return rows


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view: a 2-D tensor column-major, a 1-D one every other element."""
    if t.dim() == 2:
        return t.T.contiguous().T
    return torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0]
