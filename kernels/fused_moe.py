"""Fused mixture-of-experts matmuls (vLLM's fused_moe layout): each (token, choice) slot is sorted by its expert and
padded to whole BLOCK_M blocks, so one kernel launch multiplies every block by its own expert's weight, for gate/up
and again for down. INT8 expert weights are dequantized inside the kernel (per-output-channel scale after the dot).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.kernels._triton import cdiv, dot_precision, tl, triton


@dataclass(frozen=True)
class ExpertBlocks:
    """Slots (token * top_k + choice) grouped by expert, each expert's run padded to a multiple of block_m.

    Sized by an upper bound, not by the counts, so building it never waits for the device: blocks past
    num_padded (and padding slots, which hold num_slots) are skipped by the kernel."""
    sorted_slots: torch.Tensor  # int32 [num_blocks * block_m]
    block_experts: torch.Tensor  # int32 [num_blocks]
    num_padded: torch.Tensor  # int32 [1]: slots in use, padding included
    block_m: int
    num_slots: int


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids [T, top_k] expert of each slot -> the slots sorted by expert (stable) and padded per expert."""
    flat = ids.flatten()
    slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    num_blocks = cdiv(slots + num_experts * (block_m - 1), block_m)
    sorted_slots = torch.full((num_blocks * block_m,), slots, dtype=torch.int32, device=flat.device)
    sorted_slots[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_slots, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32), block_m, slots)


@triton.jit
def _moe_matmul_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr, weights_ptr, slots_ptr, experts_ptr, num_padded_ptr, N, K, num_slots,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_cm, stride_cn,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr, INT8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """c[slot] = a[slot // ROWS_PER_A] @ b[expert].T for the BLOCK_M slots of one block (one expert)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots // ROWS_PER_A, 0)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + rk[:, None] * stride_bk + rn[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if INT8:  # the per-channel scale factors out of the sum over K
        scale = tl.load(scale_ptr + expert * stride_se + rn * stride_sn, mask=rn < N, other=0.0)
        acc = acc * scale.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + slots[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


def block_m_for(slots: int, num_experts: int) -> int:
    """Thin blocks when few slots land on each expert (decode): padding is then most of the work."""
    return 16 if slots <= 2 * num_experts * 16 else 64


def _moe_matmul(a, w, scale, blocks: ExpertBlocks, rows_per_a: int, weights: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(blocks.num_slots, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 32 if k < 64 else 64
    grid = (blocks.block_experts.numel(), cdiv(n, block_n))
    scale = w if scale is None else scale  # unread unless INT8
    _moe_matmul_kernel[grid](
        a, w, scale, out, out if weights is None else weights, blocks.sorted_slots, blocks.block_experts,
        blocks.num_padded, n, k, blocks.num_slots, *a.stride(), *w.stride(), scale.stride(0), scale.stride(-1),
        *out.stride(), ROWS_PER_A=rows_per_a, MUL_WEIGHT=weights is not None, INT8=w.dtype == torch.int8,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(a.dtype),
    )
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; weights/ids [T, top_k] -> [T, H] in x's dtype.

    Weights are x's dtype, or int8 with per-channel scales w13_scale [E, 2I] and w2_scale [E, H]. The choices of a
    token are summed in ids' order."""
    t, top_k = ids.shape
    if t == 0:
        return torch.empty_like(x)
    blocks = expert_blocks(ids, w13.shape[0], block_m_for(ids.numel(), w13.shape[0]))
    gate_up = _moe_matmul(x, w13, w13_scale, blocks, top_k, None)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    out = _moe_matmul(h, w2, w2_scale, blocks, 1, weights.flatten().contiguous())
    return out.view(t, top_k, -1).sum(1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: every slot's expert weights gathered and applied densely, in float32."""
    if w13_scale is not None:
        w13, w2 = w13.float() * w13_scale.float()[..., None], w2.float() * w2_scale.float()[..., None]
    gate_up = torch.einsum("th,tknh->tkn", x.float(), w13.float()[ids])
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2.float()[ids])
    return (y * weights.float()[..., None]).sum(1).to(x.dtype)
