"""Multi-LoRA matmuls (Punica's SGMV): the rows of a batch are grouped by adapter slot into segments, and one launch
multiplies every segment by its own adapter, shrink (x @ A.T, to rank R) then expand (y += t @ B.T, back out).

Adapters of different ranks share one stack zero-padded to the largest rank: padded rows of A give exact zeros in t
and padded columns of B add exact zeros to y, so padding changes no result.
"""

import torch

from sluice.kernels._triton import cdiv, dot_precision, next_pow2, tl, triton


def lora_segments(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [N] int64 (-1: no adapter) -> (order [M] int64, seg_starts [G + 1] int32, seg_slots [G] int32).

    order lists the rows with an adapter, stably sorted by slot; segment g is order[seg_starts[g]:seg_starts[g + 1]]
    and uses adapter seg_slots[g]. Rows with slot -1 are left out, so the kernels never touch them."""
    rows = torch.nonzero(slots >= 0).flatten()
    by_slot = torch.argsort(slots[rows], stable=True)
    order = rows[by_slot]
    seg_slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
    seg_starts = torch.zeros(seg_slots.numel() + 1, dtype=torch.int32, device=slots.device)
    seg_starts[1:] = counts.cumsum(0)
    return order, seg_starts, seg_slots.to(torch.int32)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, t_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, R, K,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_tm, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """t[pos] = x[order[pos]] @ a[slot].T for BLOCK_M positions of one segment and BLOCK_R of the rank."""
    seg = tl.program_id(0)
    first = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_starts_ptr + seg + 1)
    if first >= end:  # the grid covers the longest segment: past a shorter one's end there is nothing to do
        return
    pos = first + tl.arange(0, BLOCK_M)  # positions in order, not rows of x
    valid = pos < end
    rows = tl.load(order_ptr + pos, mask=valid, other=0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)  # int64: slot * stride overflows int32 for large stacks
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + rk[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + rk[:, None] * stride_ak + rr[None, :] * stride_ar  # [BLOCK_K, BLOCK_R] of a.T
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=valid[:, None] & (k0 + rk[None, :] < K), other=0.0)
        a = tl.load(a_ptrs, mask=(rr[None, :] < R) & (k0 + rk[:, None] < K), other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    t_ptrs = t_ptr + pos[:, None] * stride_tm + rr[None, :] * stride_tr
    tl.store(t_ptrs, acc, mask=valid[:, None] & (rr[None, :] < R))


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, N, R,
    stride_tm, stride_tr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[order[pos]] += t[pos] @ b[slot].T for BLOCK_M positions of one segment and BLOCK_N output columns."""
    seg = tl.program_id(0)
    first = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_starts_ptr + seg + 1)
    if first >= end:
        return
    pos = first + tl.arange(0, BLOCK_M)
    valid = pos < end
    rows = tl.load(order_ptr + pos, mask=valid, other=0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    t_ptrs = t_ptr + pos[:, None] * stride_tm + rr[None, :] * stride_tr
    b_ptrs = b_ptr + slot * stride_bs + rr[:, None] * stride_br + rn[None, :] * stride_bn  # [BLOCK_R, BLOCK_N] of b.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):  # one pass for ranks up to 128
        t = tl.load(t_ptrs, mask=valid[:, None] & (r0 + rr[None, :] < R), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & (r0 + rr[:, None] < R), other=0.0)
        # t is float32: half models round it to b's dtype here, once, for the tensor cores (vLLM's expand does too).
        acc = tl.dot(t.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
        t_ptrs += BLOCK_R * stride_tr
        b_ptrs += BLOCK_R * stride_br
    # Each row of y is in order at most once, so this program alone owns its tile: a plain read-add-write.
    y_ptrs = y_ptr + rows[:, None] * stride_ym + rn[None, :] * stride_yn
    mask = valid[:, None] & (rn[None, :] < N)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def block_m_for(max_seg_len: int) -> int:
    """Thin tiles for decode (a few rows per adapter), where the rows of a tile past a segment's end are waste."""
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def _block_r(r: int) -> int:
    """The whole rank in one tile up to 128 (tl.dot needs at least 16), so shrink reads each x tile once."""
    return min(max(next_pow2(r), 16), 128)


def _check_segments(name: str, m: int, order, seg_starts, seg_slots, device) -> None:
    for what, tensor, dtype in (("order", order, torch.int64), ("seg_starts", seg_starts, torch.int32),
                                ("seg_slots", seg_slots, torch.int32)):
        if tensor.dtype != dtype or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device != device:
            raise ValueError(f"{name}: {what} must be a contiguous 1-D {dtype} tensor on {device}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
                             f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    if order.numel() != m or seg_starts.numel() != seg_slots.numel() + 1:
        raise ValueError(f"{name}: order [{order.numel()}] must have M = {m} entries and seg_starts "
                         f"[{seg_starts.numel()}] one more than seg_slots [{seg_slots.numel()}]")


def _max_seg_len(seg_starts: torch.Tensor, max_seg_len: int | None) -> int:
    # Reading it from seg_starts waits for the device: a caller that knows it (lora_segments' counts) passes it.
    return int((seg_starts[1:] - seg_starts[:-1]).max()) if max_seg_len is None else max_seg_len


def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, *, max_seg_len: int | None = None) -> torch.Tensor:
    """x [N, K]; a [S, R, K] in x's dtype -> t [M, R] float32, t[m] = x[order[m]] @ a[slot of m].T.

    t stays float32 (it is small: M x R): half models round it only once, inside lora_expand, and a split-K shrink
    for decode (few segments, long K) could add its partial sums into it. max_seg_len, when given, must be at least
    the longest segment (shorter drops rows); it spares reading it back from seg_starts. Slots are not bounds-checked
    against S (that would wait for the device): lora_segments' input must index a's stack."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} must be [N, K] with a {tuple(a.shape)} = [S, R, K]")
    if a.dtype != x.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"lora_shrink: x and a must share one float dtype, got {x.dtype} and {a.dtype}")
    _check_segments("lora_shrink", order.numel(), order, seg_starts, seg_slots, x.device)
    m, (_, r, k) = order.numel(), a.shape
    t = torch.empty(m, r, dtype=torch.float32, device=x.device)
    if m == 0:  # no row has an adapter
        return t
    longest = _max_seg_len(seg_starts, max_seg_len)
    block_m, block_r = block_m_for(longest), _block_r(r)
    grid = (seg_slots.numel(), cdiv(longest, block_m), cdiv(r, block_r))
    _lora_shrink_kernel[grid](
        x, a, t, order, seg_starts, seg_slots, r, k, *x.stride(), *a.stride(), *t.stride(),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=32 if k < 64 else 64, DOT_PRECISION=dot_precision(x.dtype),
    )
    return t


def lora_expand(t: torch.Tensor, b: torch.Tensor, order: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, y: torch.Tensor, *, max_seg_len: int | None = None) -> None:
    """t [M, R] (float32 from lora_shrink, or b's dtype); b [S, Nout, R]; y [N, Nout] in b's dtype, updated in place:
    y[order[m]] += t[m] @ b[slot of m].T, summed in float32 and rounded once. Rows of y not in order are untouched.

    y may be a strided view (a column slice of a fused projection's output, say)."""
    if t.dim() != 2 or b.dim() != 3 or y.dim() != 2 or b.shape[2] != t.shape[1] or b.shape[1] != y.shape[1]:
        raise ValueError(f"lora_expand: t {tuple(t.shape)} must be [M, R], b {tuple(b.shape)} [S, Nout, R] "
                         f"and y {tuple(y.shape)} [N, Nout]")
    if y.dtype != b.dtype or t.dtype not in (torch.float32, b.dtype):
        raise ValueError(f"lora_expand: y and b must share one dtype and t be float32 or that dtype, got "
                         f"y {y.dtype}, b {b.dtype}, t {t.dtype}")
    _check_segments("lora_expand", t.shape[0], order, seg_starts, seg_slots, y.device)
    m, (_, n, r) = t.shape[0], b.shape
    if m == 0:
        return
    longest = _max_seg_len(seg_starts, max_seg_len)
    block_m, block_n = block_m_for(longest), 64
    grid = (seg_slots.numel(), cdiv(longest, block_m), cdiv(n, block_n))
    _lora_expand_kernel[grid](
        t, b, y, order, seg_starts, seg_slots, n, r, *t.stride(), *b.stride(), *y.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(r), DOT_PRECISION=dot_precision(b.dtype),
    )


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference: delta[i] = x[i] @ a[slots[i]].T @ b[slots[i]].T in float32, zero where slots[i] == -1; x's dtype."""
    has = slots >= 0
    idx = slots.clamp(min=0)
    t = torch.bmm(x.float()[:, None, :], a.float()[idx].transpose(1, 2))  # [N, 1, R]
    delta = torch.bmm(t, b.float()[idx].transpose(1, 2))[:, 0]
    return torch.where(has[:, None], delta, 0.0).to(x.dtype)
