"""Attention backend on the Triton kernels (CUDA, or Triton's interpreter): same cache layout as TorchAttention."""

from __future__ import annotations

import torch

from sluice.worker.engine.attention import AttentionMetadata, LayerCache


class TritonAttention:
    def __init__(self) -> None:
        # imported here so CPU-only installs never need triton
        from sluice.kernels.decode_attention import paged_decode_attention
        from sluice.kernels.kv_store import store_kv
        from sluice.kernels.prefill_attention import paged_prefill_attention

        self._decode, self._prefill, self._store = paged_decode_attention, paged_prefill_attention, store_kv

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
        self._store(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        masking = dict(sliding_window=meta.sliding_window, softcap=softcap)
        if nd:
            self._decode(q[:nd], cache.k, cache.v, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                         cache.k_scale, cache.v_scale, out=out[:nd], **masking)
        if nd < len(meta.query_lens):  # decode rows hold one token each, so prefill tokens start at row nd
            self._prefill(q[nd:], cache.k, cache.v, meta.block_tables[nd:], meta.cu_seqlens_q[nd:] - nd,
                          meta.context_lens[nd:], scale, cache.k_scale, cache.v_scale, out=out[nd:], **masking)
        return out
