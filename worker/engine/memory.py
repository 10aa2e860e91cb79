"""The engine's memory arithmetic on a GPU: KV bytes per token, activation headroom, the KV cache's share of what is
free. The model runner sizes its cache with it and `sluice plan` predicts that size from config.json."""

from __future__ import annotations

import torch

from sluice.worker.engine.config import CUDA_MEMORY_FRACTION, ModelConfig

KV_INT8_SCALE_BYTES = 4  # an INT8 cache keeps a float32 scale per token and head beside K and V


def kv_bytes_per_token(c: ModelConfig, dtype: torch.dtype, kv_int8: bool) -> int:
    """K and V of one token in every layer (every layer holds a full cache, sliding or not)."""
    per_head = c.head_dim + KV_INT8_SCALE_BYTES if kv_int8 else c.head_dim * dtype.itemsize
    return 2 * c.num_layers * c.num_kv_heads * per_head


def activation_bytes(c: ModelConfig, max_num_batched_tokens: int) -> int:
    """Headroom for one step's largest float32 intermediates: the MLP's gate and up, and the logits."""
    return max_num_batched_tokens * (c.intermediate_size * 2 + c.vocab_size) * 4


def kv_cache_budget(free: int, activations: int) -> int:
    """Bytes the KV cache may take of the memory free after the weights."""
    return int((free - activations) * CUDA_MEMORY_FRACTION)
