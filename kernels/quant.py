"""INT8/INT4 weight and INT8 KV-cache formats: quantize, dequantize and nibble packing in plain PyTorch."""

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale as it will be stored; an all-zero row (or one that underflows the dtype) gets 1 so q = 0."""
    scale = scale.to(dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: w [N, K] -> (qweight int8 [N, K], scale [N] in w's dtype)."""
    w32 = w.float()
    scale = _stored_scale(w32.abs().amax(dim=1) / 127, w.dtype)
    # Quantize against the stored (rounded) scale so |w - q * scale| <= scale / 2 holds for what is kept.
    q = torch.round(w32 / scale.float()[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """qweight int8 [N, K], scale [N] -> weight [N, K] in scale's dtype (computed in float32)."""
    return (qweight.float() * scale.float()[:, None]).to(scale.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] with values in [0, 15] -> [N, K // 2]: low nibble = column 2i, high nibble = 2i + 1."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: K={q.shape[-1]} must be even")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K // 2] -> q uint8 [N, K], inverse of pack_int4."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise INT4 along K (gpt-fast convention, w = (q - 8) * scale + zero).

    w [N, K] -> (qweight uint8 [N, K // 2] packed, scales [N, K // G], zeros [N, K // G]) in w's dtype.
    """
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"quantize_int4: group_size={group_size} must be one of {INT4_GROUP_SIZES} and divide K={k}")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).to(w.dtype)
    # The zero point from the scale before a 0 becomes 1: a constant group gets zero = its value (q = 8), exact;
    # lo + 8 * 1 would round small values away (0.01 + 8 is 8.0 in bfloat16, so the group came back as 0).
    zeros = (lo + 8 * scales.float()).to(w.dtype)
    scales = _stored_scale(scales, w.dtype)
    # Round against the stored scale and zero: q is then the nearest point of the grid that dequantizes.
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return pack_int4(q.reshape(n, k)), scales, zeros


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Packed qweight [N, K // 2], scales/zeros [N, K // G] -> weight [N, K] in scales' dtype (float32 math)."""
    q = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return ((q - 8) * s + z).to(scales.dtype)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero: the rounding Triton can express, so the KV store matches bit for bit."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per token and head: x [..., head_dim] -> (q int8 [..., head_dim], scale float32 [...])."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = round_half_away(x32 / scale[..., None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..., head_dim], scale float32 [...] -> [..., head_dim] in dtype."""
    return (q.float() * scale[..., None]).to(dtype)
