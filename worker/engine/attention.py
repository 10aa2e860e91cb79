"""Attention over the paged KV cache: step metadata, the backend interface and its pure-PyTorch backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


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
    """One layer's K and V cache, [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


class AttentionBackend(Protocol):
    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchAttention:
    """Reference backend in plain PyTorch, for CPU and CUDA: gathers each sequence's blocks, then SDPA."""

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
        nb, bs, h, d = cache.k.shape
        cache.k.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, v)

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, scale)
        for i in range(nd, len(meta.query_lens)):
            start, end = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
            out[start:end] = self._prefill(q[start:end], cache, meta, i, scale)
        return out

    def _decode(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = q.shape[0]
        bs = cache.k.shape[1]
        ctx = meta.context_lens[:nd]
        num_blocks = -(-max(meta.context_lens_list[:nd]) // bs)
        table = meta.block_tables[:nd, :num_blocks]
        k = _gather(cache.k, table)  # [nd, kv_heads, L, d]
        v = _gather(cache.v, table)
        pos = torch.arange(k.shape[2], device=q.device)
        mask = pos[None, :] < ctx[:, None]
        if meta.sliding_window is not None:
            mask &= pos[None, :] > (ctx[:, None] - 1 - meta.sliding_window)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, i: int, scale: float):
        bs = cache.k.shape[1]
        n, ctx = q.shape[0], meta.context_lens_list[i]
        table = meta.block_tables[i:i + 1, : -(-ctx // bs)]
        k = _gather(cache.k, table)[:, :, :ctx]
        v = _gather(cache.v, table)[:, :, :ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if meta.sliding_window is not None:
            mask &= q_pos - k_pos < meta.sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, h, d] cache and [rows, n] block ids -> contiguous [rows, h, n * bs, d]."""
    rows, n = table.shape
    blocks = cache[table.reshape(-1).long()]  # [rows * n, bs, h, d]
    return blocks.view(rows, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
