"""Layout checks of the paged KV cache and the attention inputs, shared by the Triton kernels, their references and
the CPU kernel. Torch only: a CPU engine imports these without importing Triton."""

import torch


def check_kv_cache(op: str, k_cache, v_cache, num_kv_heads: int | None, head_dim: int, k_scale, v_scale) -> bool:
    """Validates the cache pair (and its scales when it is int8); returns whether it is int8."""
    want = f"[blocks, block_size, {num_kv_heads or 'kv_heads'}, {head_dim}]"
    shape_ok = k_cache.dim() == 4 and k_cache.shape[3] == head_dim and k_cache.shape == v_cache.shape
    if not shape_ok or (num_kv_heads is not None and k_cache.shape[2] != num_kv_heads):
        raise ValueError(f"{op}: k_cache and v_cache {tuple(k_cache.shape)} must both be {want}")
    if k_cache.stride() != v_cache.stride():  # the kernels address both with one set of strides
        raise ValueError(f"{op}: k_cache and v_cache must share one memory layout")
    if k_cache.dtype != torch.int8:
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.shape != k_cache.shape[:3] or scale.dtype != torch.float32:
            raise ValueError(f"{op}: an int8 cache needs {name} float32 {tuple(k_cache.shape[:3])}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"{op}: k_scale and v_scale must share one memory layout")
    return True


def check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale) -> bool:
    """Validates shapes (for the Triton kernel, its reference and the CPU kernel); returns whether the cache is INT8."""
    num_seqs, num_heads, head_dim = q.shape
    quantized = check_kv_cache("decode attention", k_cache, v_cache, None, head_dim, k_scale, v_scale)
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"decode attention: num_heads={num_heads} must be a multiple of kv_heads={k_cache.shape[2]}")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"decode attention: block_tables and context_lens must have {num_seqs} rows")
    return quantized
