"""Writes new tokens' K/V into the paged cache at their slots, quantizing to INT8 on the fly when the cache is int8."""

import torch

from sluice.kernels._triton import next_pow2, tl, triton
from sluice.kernels.checks import check_kv_cache
from sluice.kernels.quant import quantize_kv_int8


@triton.jit
def _store_one(
    x_ptr, cache_ptr, scale_ptr, token, page, offset,
    stride_xt, stride_xh, stride_xd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :] * stride_xd, mask=mask, other=0.0)
    dst = cache_ptr + page * stride_cb + offset * stride_co + h[:, None] * stride_ch + d[None, :] * stride_cd
    if QUANTIZE:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        # div_rn: correctly rounded division, so scales and codes match quantize_kv_int8 exactly.
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
        y = tl.math.div_rn(x, scale[:, None])
        q = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + page * stride_sb + offset * stride_so + h * stride_sh, scale, mask=h < NUM_HEADS)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_xt, stride_xh, stride_xd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _store_one(k_ptr, k_cache_ptr, k_scale_ptr, token, page, offset, stride_xt, stride_xh, stride_xd,
               stride_cb, stride_co, stride_ch, stride_cd, stride_sb, stride_so, stride_sh,
               NUM_HEADS, HEAD_DIM, HEADS_PAD, DIM_PAD, QUANTIZE)
    _store_one(v_ptr, v_cache_ptr, v_scale_ptr, token, page, offset, stride_xt, stride_xh, stride_xd,
               stride_cb, stride_co, stride_ch, stride_cd, stride_sb, stride_so, stride_sh,
               NUM_HEADS, HEAD_DIM, HEADS_PAD, DIM_PAD, QUANTIZE)


def _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    """Validates shapes and returns whether the cache is INT8."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [tokens, kv_heads, dim]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{k.shape[0]}]")
    return check_kv_cache("store_kv", k_cache, v_cache, k.shape[1], k.shape[2], k_scale, v_scale)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v [tokens, kv_heads, dim] -> cache slots (slot = block * block_size + offset; -1 skips the token)."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.stride() != v.stride():  # one set of strides serves both inputs
        k, v = k.contiguous(), v.contiguous()
    slot_mapping = slot_mapping.contiguous()  # the kernel reads it as packed
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if not quantized:
        k_scale = v_scale = k_cache  # never read: stand-ins so the kernel gets a pointer
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        *k.stride(), *k_cache.stride(), *k_scale.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_heads), DIM_PAD=next_pow2(head_dim), QUANTIZE=quantized,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for store_kv (needs contiguous caches, as the engine allocates them)."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        if quantized:
            q, s = quantize_kv_int8(x)
            flat[slots] = q
            scale.view(-1, scale.shape[2])[slots] = s
        else:
            flat[slots] = x.to(cache.dtype)
