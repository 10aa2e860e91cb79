"""Paged causal prefill attention over packed variable-length queries (chunked prefill and cached prefixes),
optionally within a sliding window and with soft-capped scores."""

import torch

from sluice.kernels._triton import dot_precision, next_pow2, tl, triton
from sluice.kernels.checks import check_kv_cache
from sluice.kernels.paged import cap_args, gather_context, paged_scores, reference_scores, scale_scores, softmax_step

BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # keys per inner step; not below BLOCK_M, so a window's first step gives every row a key


@triton.jit
def _find_seq(cu_seqlens_ptr, block_id, num_seqs, BLOCK_M: tl.constexpr):
    """Sequence owning query block block_id; sequence b's blocks start at cu_seqlens[b] // BLOCK_M + b."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_ptr + mid) // BLOCK_M + mid <= block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
    out_ptr, qk_scale, cap_in, cap_out, window, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # The grid has one spare block per sequence so it can be sized without reading cu_seqlens on the host.
    block_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = _find_seq(cu_seqlens_ptr, block_id, num_seqs, BLOCK_M)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    first_row = (block_id - q_start // BLOCK_M - seq) * BLOCK_M
    if first_row >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len  # cached tokens before this step's queries

    rows = first_row + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    q_mask = (rows[:, None] < q_len) & (d[None, :] < HEAD_DIM)
    q_off = (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    # rows past q_len (not stored) take the last row's position, so their window holds keys and they stay finite
    q_pos = prefix + tl.minimum(rows, q_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    kv_end = tl.minimum(context_len, prefix + first_row + BLOCK_M)  # keys after the block's last query are masked
    kv_start = prefix * 0
    if window > 0:  # keys before the block's first query's window are masked
        kv_start = tl.maximum(prefix + first_row - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        s, v, valid = paged_scores(
            q, pos, kv_end, seq, kv_head, d, block_tables_ptr, stride_bt, k_cache_ptr, v_cache_ptr, stride_cb,
            stride_co, stride_ch, stride_cd, k_scale_ptr, v_scale_ptr, stride_sb, stride_so, stride_sh, BLOCK_SIZE,
            HEAD_DIM, INT8_KV, DOT_PRECISION)
        causal = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            causal = causal & (q_pos[:, None] - pos[None, :] < window)
        # finite maximum: the first step holds a key every row sees (key 0, or with a window the first row's first key
        # up to the last row's own: BLOCK_N >= BLOCK_M keys)
        s = scale_scores(s, qk_scale, cap_in, cap_out, SOFTCAP)
        m_i, l_i, acc = softmax_step(tl.where(causal, s, float("-inf")), v, m_i, l_i, acc, DOT_PRECISION)

    o_off = (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale) -> bool:
    """Validates shapes and returns whether the cache is INT8."""
    num_heads, head_dim = q.shape[1:]
    quantized = check_kv_cache("prefill attention", k_cache, v_cache, None, head_dim, k_scale, v_scale)
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"prefill attention: num_heads={num_heads} must be a multiple of kv_heads={k_cache.shape[2]}")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"prefill attention: block_tables and context_lens need {num_seqs} rows (cu_seqlens_q - 1)")
    return quantized


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [total_q, heads, dim], packed by cu_seqlens_q; query i of sequence b sits at context_lens[b] - q_len_b + i
    and attends causally to the paged cache (which already holds this step's K/V), to its last `sliding_window` keys
    if given -> [total_q, heads, dim]. With `softcap`, scores are softcap * tanh(scores / softcap)."""
    quantized = _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    # the kernel reads these with a row stride at most: a strided view would be read as if packed
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q) if out is None else out
    if total_q == 0:
        return out
    scales = (k_scale, v_scale) if quantized else (k_cache, k_cache)  # stand-ins are never read
    _prefill_kernel[(total_q // BLOCK_M + num_seqs, num_heads)](
        q, k_cache, v_cache, *scales, block_tables, cu_seqlens_q, context_lens, out, *cap_args(scale, softcap),
        sliding_window or 0, num_seqs,
        *q.stride(), *k_cache.stride(), *scales[0].stride()[:3], block_tables.stride(0), *out.stride(),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=max(16, next_pow2(head_dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        INT8_KV=quantized, DOT_PRECISION=dot_precision(q.dtype), SOFTCAP=bool(softcap), num_warps=4, num_stages=2,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference: per sequence, gathers the context and runs masked (causal, windowed) softmax attention over
    soft-capped scores in float32."""
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, k_scale, v_scale)
    out = torch.empty_like(q) if out is None else out
    bounds = cu_seqlens_q.tolist()
    for i, n in enumerate(context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        k, v = gather_context(k_cache, v_cache, block_tables, i, n, k_scale, v_scale, q.shape[1])
        pos = torch.arange(n, device=q.device)
        q_pos = torch.arange(n - (end - start), n, device=q.device)
        scores = reference_scores(torch.einsum("thd,nhd->htn", q[start:end].float(), k), scale, softcap)
        hidden = pos[None, :] > q_pos[:, None]
        if sliding_window:
            hidden |= q_pos[:, None] - pos[None, :] >= sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[start:end] = torch.einsum("htn,nhd->thd", scores.softmax(dim=-1), v).to(out.dtype)
    return out
