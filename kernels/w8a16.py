"""W8A16 matmul: y = x @ (qweight * scale[:, None]).T with INT8 weights dequantized inside the kernel."""

from dataclasses import dataclass

import torch

from sluice.kernels._triton import cdiv, dot_precision, tl, triton
from sluice.kernels.quant import dequantize_int8


@dataclass(frozen=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(m: int) -> MatmulTiles:
    """Decode (small M) is bound by reading weights: thin M tiles, narrow N tiles for more programs, deep K.
    Prefill (large M) is bound by compute: square tiles that reuse each loaded weight tile across many rows."""
    if m <= 16:
        return MatmulTiles(16, 32, 256, num_warps=4, num_stages=4)
    if m <= 32:
        return MatmulTiles(32, 64, 128, num_warps=4, num_stages=4)
    if m <= 64:
        return MatmulTiles(64, 64, 128, num_warps=4, num_stages=3)
    return MatmulTiles(128, 128, 64, num_warps=8, num_stages=3)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] view of w.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_mask = rm[:, None] < M
        w_mask = rn[None, :] < N
        if not EVEN_K:  # K-masks only where needed: they break vectorized loads along K
            x_mask = x_mask & (k0 + rk[None, :] < K)
            w_mask = w_mask & (k0 + rk[:, None] < K)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        # |q| <= 127 is exact in fp16/bf16, so the tensor-core product sees the true integers.
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    # The per-channel scale factors out of the sum over K: one multiply per output instead of per weight.
    acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _check(x, qweight, scale) -> None:
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"w8a16: x {tuple(x.shape)} must be [M, K] with qweight {tuple(qweight.shape)} = [N, K]")
    if qweight.dtype != torch.int8 or scale.shape != (qweight.shape[0],):
        raise ValueError(f"w8a16: qweight must be int8 and scale [{qweight.shape[0]}], "
                         f"got {qweight.dtype} and {tuple(scale.shape)}")


def w8a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16), qweight int8 [N, K], scale [N] -> [M, N] in x's dtype."""
    _check(x, qweight, scale)
    scale = scale.contiguous()  # the kernel reads it as packed
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    t = tiles_for(m)
    _w8a16_kernel[(cdiv(m, t.block_m), cdiv(n, t.block_n))](
        x, qweight, scale, out, m, n, k, *x.stride(), *qweight.stride(), *out.stride(),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=k % t.block_k == 0,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def w8a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: dequantize the whole weight, then an ordinary matmul accumulated in float32."""
    _check(x, qweight, scale)
    y = x.float() @ dequantize_int8(qweight, scale).float().T
    return y.to(x.dtype) if out is None else out.copy_(y)
