"""W4A16 matmul: y = x @ W.T with group-wise INT4 weights (two per byte) dequantized inside the kernel."""

import torch

from sluice.kernels._triton import cdiv, dot_precision, tl, triton
from sluice.kernels.quant import INT4_GROUP_SIZES, dequantize_int4
from sluice.kernels.w8a16 import tiles_for


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)  # packed bytes per K tile
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rb[None, :] * stride_wk  # [BLOCK_N, BLOCK_K // 2] bytes
    x_mask = rm[:, None] < M
    w_mask = rn[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # BLOCK_K divides GROUP_SIZE which divides K: no K masks, and each tile sits inside one group.
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        packed = tl.load(w_ptrs, mask=w_mask, other=0)
        q = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: low nibble is the even column
        g = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + rn * stride_sn + g * stride_sg, mask=rn < N, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + rn * stride_sn + g * stride_sg, mask=rn < N, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - 8.0) * s[:, None] + z[:, None]).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 2) * stride_wk
    o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _check(x, qweight, scales, zeros, group_size) -> None:
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != 2 * qweight.shape[1]:
        raise ValueError(f"w4a16: x {tuple(x.shape)} must be [M, K] with qweight {tuple(qweight.shape)} = [N, K // 2]")
    k = x.shape[1]
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"w4a16: group_size={group_size} must be one of {INT4_GROUP_SIZES} and divide K={k}")
    groups = (qweight.shape[0], k // group_size)
    if qweight.dtype != torch.uint8 or scales.shape != groups or zeros.shape != groups:
        raise ValueError(f"w4a16: qweight must be uint8 and scales, zeros {groups}, got {qweight.dtype}, "
                         f"{tuple(scales.shape)}, {tuple(zeros.shape)}")
    if scales.stride() != zeros.stride():
        raise ValueError("w4a16: scales and zeros must share one layout")


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K], qweight uint8 [N, K // 2], scales/zeros [N, K // group_size] -> [M, N] in x's dtype."""
    _check(x, qweight, scales, zeros, group_size)
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    t = tiles_for(m)
    block_k = min(t.block_k, group_size)
    _w4a16_kernel[(cdiv(m, t.block_m), cdiv(n, t.block_n))](
        x, qweight, scales, zeros, out, m, n, k,
        *x.stride(), *qweight.stride(), *scales.stride(), *out.stride(),
        GROUP_SIZE=group_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: dequantize the whole weight, then an ordinary matmul accumulated in float32."""
    _check(x, qweight, scales, zeros, group_size)
    y = x.float() @ dequantize_int4(qweight, scales, zeros, group_size).float().T
    return y.to(x.dtype) if out is None else out.copy_(y)
