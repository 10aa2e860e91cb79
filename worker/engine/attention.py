"""Attention over the paged KV cache: step metadata, the backend interface and its pure-PyTorch backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.quant import dequantize_kv_int8, quantize_kv_int8


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Rows are sequences; the first `num_decodes` have exactly one query token. Tokens are packed
    sequence after sequence, with no padding.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int
    query_lens: list[int]
    context_lens_list: list[int]
    sliding_window: int | None = None


@dataclass
class LayerCache:
    """One layer's K and V cache, [num_blocks, block_size, num_kv_heads, head_dim]; with an INT8 cache, the
    per-token-and-head scales [num_blocks, block_size, num_kv_heads] in float32."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class AttentionBackend(Protocol):
    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


DECODE_BUCKET = 32  # decode rows attended together; rows arrive sorted by context, so each bucket pads little


class TorchAttention:
    """Reference backend in plain PyTorch, for CPU and CUDA: gathers each sequence's blocks, then SDPA."""

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
        if cache.k_scale is not None:
            k, k_scale = quantize_kv_int8(k)
            v, v_scale = quantize_kv_int8(v)
            cache.k_scale.view(-1, k_scale.shape[-1]).index_copy_(0, meta.slot_mapping, k_scale)
            cache.v_scale.view(-1, v_scale.shape[-1]).index_copy_(0, meta.slot_mapping, v_scale)
        nb, bs, h, d = cache.k.shape
        cache.k.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, v)

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for start in range(0, meta.num_decodes, DECODE_BUCKET):
            rows = slice(start, min(start + DECODE_BUCKET, meta.num_decodes))
            out[rows] = self._decode(q[rows], cache, meta, rows, scale)
        for i in range(meta.num_decodes, len(meta.query_lens)):
            start, end = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
            out[start:end] = self._prefill(q[start:end], cache, meta, i, scale)
        return out

    def _decode(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, rows: slice, scale: float):
        n, heads, d = q.shape
        kv_heads = cache.k.shape[2]
        ctx = meta.context_lens[rows]
        length = max(meta.context_lens_list[rows])
        table = meta.block_tables[rows, : -(-length // cache.k.shape[1])]
        k, v = _gather(cache, table, q.dtype)  # [n, kv_heads, L, d]
        pos = torch.arange(k.shape[2], device=q.device)
        mask = pos[None, :] < ctx[:, None]
        if meta.sliding_window is not None:
            mask &= pos[None, :] > (ctx[:, None] - 1 - meta.sliding_window)
        # each KV head's group of query heads forms its query rows: GQA without repeating K/V
        out = F.scaled_dot_product_attention(
            q.view(n, kv_heads, heads // kv_heads, d), k, v, attn_mask=mask[:, None, None, :], scale=scale
        )
        return out.reshape(n, heads, d)

    def _prefill(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, i: int, scale: float):
        n, ctx = q.shape[0], meta.context_lens_list[i]
        table = meta.block_tables[i:i + 1, : -(-ctx // cache.k.shape[1])]
        k, v = _gather(cache, table, q.dtype)
        k, v = k[:, :, :ctx], v[:, :, :ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if meta.sliding_window is not None:
            mask &= q_pos - k_pos < meta.sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)


def _gather(cache: LayerCache, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of `table` [rows, n] as contiguous K and V [rows, kv_heads, n * block_size, head_dim]."""
    rows, n = table.shape
    ids = table.reshape(-1)
    k, v = cache.k.index_select(0, ids), cache.v.index_select(0, ids)  # [rows * n, bs, h, d]
    if cache.k_scale is not None:
        k = dequantize_kv_int8(k, cache.k_scale.index_select(0, ids), dtype)
        v = dequantize_kv_int8(v, cache.v_scale.index_select(0, ids), dtype)
    shape = (rows, n * cache.k.shape[1], cache.k.shape[2], cache.k.shape[3])
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
