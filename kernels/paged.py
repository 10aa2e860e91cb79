"""What the store and attention kernels share about the paged KV cache: the exp2 softmax base, the reference's
context gather, and the attention kernels' inner step (a tile of keys read through the block table, scaled and
optionally soft-capped, then an online-softmax update). The layout checks are in kernels/checks.py."""

import torch

from sluice.kernels._triton import tl, triton

LOG2E = 1.4426950408889634  # the attention kernels use exp2, so scores are scaled by log2(e) once


def gather_context(k_cache, v_cache, block_tables, seq: int, length: int, k_scale, v_scale, num_heads: int):
    """Reference side: sequence `seq`'s first `length` keys and values, dequantized, each KV head repeated for its
    query heads -> float32 [length, num_heads, head_dim] twice."""
    from sluice.kernels.quant import dequantize_kv_int8

    pos = torch.arange(length, device=k_cache.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pages, offsets = block_tables[seq, pos // block_size].long(), pos % block_size
    k, v = k_cache[pages, offsets], v_cache[pages, offsets]  # [length, kv_heads, dim]
    if k_cache.dtype == torch.int8:
        k = dequantize_kv_int8(k, k_scale[pages, offsets], torch.float32)
        v = dequantize_kv_int8(v, v_scale[pages, offsets], torch.float32)
    group = num_heads // num_kv_heads
    return k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)


@triton.jit
def paged_scores(q, pos, end, seq, kv_head, d, block_tables_ptr, stride_bt, k_cache_ptr, v_cache_ptr,
                 stride_cb, stride_co, stride_ch, stride_cd, k_scale_ptr, v_scale_ptr, stride_sb, stride_so, stride_sh,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, INT8_KV: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Keys at positions `pos` (those < end valid) of sequence `seq`: raw scores q k^T and their V tile."""
    valid = pos < end
    page = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if INT8_KV:
        srow = page * stride_sb + (pos % BLOCK_SIZE) * stride_so + kv_head * stride_sh
        # The per-token K scale factors out of the dot product over head_dim: apply it to the fp32 scores.
        s = s * tl.load(k_scale_ptr + srow, mask=valid, other=0.0)[None, :]
        v_scale = tl.load(v_scale_ptr + srow, mask=valid, other=0.0)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    return s, v, valid


def cap_args(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """scale_scores' runtime arguments: qk_scale, cap_in and cap_out (the last two unused without a cap)."""
    return scale * LOG2E, scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0


def reference_scores(scores: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """Reference side: raw scores q k^T scaled, then soft-capped as transformers' Gemma 2 does."""
    scores = scores * scale
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


@triton.jit
def scale_scores(s, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw scores q k^T in the exp2 softmax's units: s * scale * log2(e); soft-capped (Gemma 2),
    softcap * tanh(s * scale / softcap) * log2(e), with cap_in = scale / softcap and cap_out = softcap * log2(e)."""
    if SOFTCAP:
        x = s * cap_in
        e = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|) never overflows: tanh|x| = (1 - e) / (1 + e)
        t = (1.0 - e) / (1.0 + e)
        s = cap_out * tl.where(x < 0, -t, t)
    else:
        s = s * qk_scale
    return s


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Online softmax (base 2): fold one tile of masked, scaled scores and its values into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
