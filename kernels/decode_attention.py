"""Paged decode attention (one query token per sequence), GQA-grouped and split along the context (flash decoding);
optionally over a sliding window of the last keys and with soft-capped scores."""

import torch

from sluice.kernels._triton import cdiv, dot_precision, next_pow2, tl, triton
from sluice.kernels.checks import check_decode_inputs
from sluice.kernels.paged import cap_args, gather_context, paged_scores, reference_scores, scale_scores, softmax_step

BLOCK_N = 64  # context tokens per inner step; independent of the cache's block_size
PARTITION_TOKENS = 512  # context one program handles before the work is split across programs
MAX_SPLITS = 32


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, cap_in, cap_out, window, partition_size, num_heads, num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    stride_os, stride_oh, stride_od,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    INT8_KV: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = _first_key(context_len, window) + part * partition_size  # partitions tile the window, not the context
    if start >= context_len:
        return  # the reduce kernel ignores partitions past the context
    end = tl.minimum(start + partition_size, context_len)

    # All query heads that share this KV head: each K/V tile is read once for the whole group.
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, DIM_PAD)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        s, v, valid = paged_scores(
            q, n0 + tl.arange(0, BLOCK_N), end, seq, kv_head, d, block_tables_ptr, stride_bt, k_cache_ptr,
            v_cache_ptr, stride_cb, stride_co, stride_ch, stride_cd, k_scale_ptr, v_scale_ptr, stride_sb, stride_so,
            stride_sh, BLOCK_SIZE, HEAD_DIM, INT8_KV, DOT_PRECISION)
        s = tl.where(valid[None, :], scale_scores(s, qk_scale, cap_in, cap_out, SOFTCAP), float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]
    if SPLIT:  # partials are contiguous [seqs, heads, splits(, head_dim)]
        part_row = (seq * num_heads + heads) * num_splits + part
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(part_lse_ptr + part_row, m_i + tl.log2(l_i), mask=g < GROUP)
    else:
        o_ptr = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _first_key(context_len, window):
    """The first key a query at context_len - 1 attends to: the window's first, or 0 (window 0: no window)."""
    first = context_len * 0
    if window > 0:
        first = tl.maximum(context_len - window, 0)
    return first


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, window, partition_size, num_heads, num_splits,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_parts = tl.cdiv(context_len - _first_key(context_len, window), partition_size)
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part_row = (seq * num_heads + head) * num_splits + p
    lse = tl.load(part_lse_ptr + part_row, mask=p < num_parts, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :],
                mask=(p[:, None] < num_parts) & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def num_splits_for(max_context_len: int) -> int:
    """Splits along the context: one per PARTITION_TOKENS, capped so the reduce stays small."""
    return max(1, min(cdiv(max_context_len, PARTITION_TOKENS), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [seqs, heads, dim] at position context_len - 1 attends to its whole context, or to its last
    `sliding_window` keys -> [seqs, heads, dim]; with `softcap`, scores are softcap * tanh(scores / softcap).

    num_splits defaults to num_splits_for(the keys attended: block_tables width * block_size, or the window): the
    table width bounds the longest context without reading context_lens back to the host. Rows with context_len 0
    (batch padding) are left unspecified.
    """
    quantized = check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    # the kernel reads these with a row stride at most: a strided view would be read as if packed
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    if sliding_window:
        max_context = min(max_context, sliding_window)
    num_splits = num_splits_for(max_context) if num_splits is None else num_splits
    if num_splits < 1:
        raise ValueError(f"decode attention: num_splits={num_splits} must be at least 1")
    partition_size = cdiv(cdiv(max_context, num_splits), BLOCK_N) * BLOCK_N
    num_splits = cdiv(max_context, partition_size)  # no partition that is always empty
    group = num_heads // num_kv_heads
    dim_pad = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, out  # not written: the kernel normalizes straight into out
    scales = (k_scale, v_scale) if quantized else (k_cache, k_cache)  # stand-ins are never read
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, *scales, block_tables, context_lens, out, part_out, part_lse,
        *cap_args(scale, softcap), sliding_window or 0, partition_size, num_heads, num_splits,
        *q.stride(), *k_cache.stride(), *scales[0].stride()[:3], block_tables.stride(0), *out.stride(),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group)),  # tl.dot needs M >= 16
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_N=BLOCK_N,
        INT8_KV=quantized, SPLIT=num_splits > 1, DOT_PRECISION=dot_precision(q.dtype), SOFTCAP=bool(softcap),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, context_lens, out, sliding_window or 0, partition_size, num_heads, num_splits,
            *out.stride(),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=next_pow2(num_splits), num_warps=4,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference: gathers each sequence's context (its last sliding_window keys) and runs
    softmax(cap(q k^T * scale)) v in float32.

    num_splits is accepted for signature parity; splitting does not change the result.
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    out = torch.empty_like(q) if out is None else out
    for i, n in enumerate(context_lens.tolist()):
        k, v = gather_context(k_cache, v_cache, block_tables, i, n, k_scale, v_scale, q.shape[1])
        first = max(0, n - sliding_window) if sliding_window else 0
        k, v = k[first:], v[first:]
        scores = reference_scores(torch.einsum("hd,nhd->hn", q[i].float(), k), scale, softcap)
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(out.dtype)
    return out
