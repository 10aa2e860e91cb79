"""Quantization formats: round-trip error bounds, nibble order, and edge cases (pure PyTorch, no Triton)."""

import pytest
import torch

from sluice.kernels.quant import (
    dequantize_int4,
    dequantize_int8,
    dequantize_kv_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_kv_int8,
    unpack_int4,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weights(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]  # rows spanning four decades
    w[1] = 0  # an all-zero channel
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_round_trip_within_half_a_step(dtype):
    w = _weights(16, 96, dtype)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == dtype and scale.shape == (16,)
    assert q.abs().max() <= 127
    dq = dequantize_int8(q, scale)
    # round() is off by at most half a step of the stored scale; |w| / scale <= 127 * (1 + eps) < 127.5, so the
    # clamp never adds error. Dequantizing to the weight dtype adds at most half an ulp of |w| (eps * |w|), and
    # float32 rounding of w / scale and q * scale a few ulps of |w| (1e-6 * |w|).
    eps = torch.finfo(dtype).eps
    bound = scale.float()[:, None] / 2 + (eps + 1e-6) * w.float().abs()
    assert ((dq.float() - w.float()).abs() <= bound).all()
    assert (q[1] == 0).all() and (dq[1] == 0).all()


def test_int8_scale_is_per_channel_amax():
    w = torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.1]])
    q, scale = quantize_int8(w)
    torch.testing.assert_close(scale, torch.tensor([0.01, 0.02]))
    assert q.tolist() == [[50, -127, 0], [127, 50, -5]]


def test_pack_int4_nibble_order():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]  # low nibble = column 2i, high = 2i + 1
    assert torch.equal(unpack_int4(packed), q)


def test_pack_int4_round_trip():
    q = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(dtype, group_size):
    w = _weights(8, 256, dtype)
    qweight, scales, zeros = quantize_int4(w, group_size)
    assert qweight.dtype == torch.uint8 and qweight.shape == (8, 128)
    assert scales.shape == zeros.shape == (8, 256 // group_size) and scales.dtype == zeros.dtype == dtype
    dq = dequantize_int4(qweight, scales, zeros, group_size).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    # The grid (q - 8) * s + z spans 15 steps, exactly the group's [min, max] in real arithmetic, so round()
    # errs by at most s / 2. Storing s and z in the weight dtype shifts the grid by at most eps * (|z| + 15 s),
    # and dequantizing to that dtype adds eps * |w|; all three vanish (to 1e-6) in float32.
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    bound = s / 2 + eps * (z.abs() + 16 * s + w.float().abs())
    assert ((dq - w.float()).abs() <= bound).all()
    assert (dq[1] == 0).all()


def test_int4_zero_point_convention():
    w = torch.linspace(-1.0, 2.0, 32)[None, :]  # one group: min -1, max 2
    qweight, scales, zeros = quantize_int4(w, 32)
    torch.testing.assert_close(scales, torch.tensor([[0.2]]))
    torch.testing.assert_close(zeros, torch.tensor([[-1.0 + 8 * 0.2]]))
    q = unpack_int4(qweight)[0]
    assert q[0] == 0 and q[-1] == 15  # min and max land on the ends of the grid


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_constant_groups_round_trip_exactly(dtype):
    # A constant group has nothing to spread over the grid: it must come back as its value, small ones included
    # (a zero point of value + 8 rounds 0.01 to 0 in bfloat16).
    values = torch.tensor([0.01, -0.3, 1e-3, 5.0, -100.0, 0.0])
    w = values.repeat_interleave(32)[None, :].repeat(3, 1).to(dtype)
    qweight, scales, zeros = quantize_int4(w, 32)
    assert torch.equal(dequantize_int4(qweight, scales, zeros, 32), w)


@pytest.mark.parametrize("group_size, k", [(48, 96), (32, 80)])
def test_int4_rejects_bad_groups(group_size, k):
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(4, k), group_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_int8_round_trip(dtype):
    x = (torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[2, 1] = 0
    q, scale = quantize_kv_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    # The scale is float32 from the exact amax, so the error is round()'s half step plus float32 rounding of
    # x / scale and q * scale (a few ulps of |x|: 1e-6 * |x|). Ties are common: bf16 inputs have 8-bit mantissas.
    err = (dequantize_kv_int8(q, scale, torch.float32) - x.float()).abs()
    assert (err <= scale[..., None] / 2 + 1e-6 * x.float().abs()).all()
    assert (q.abs().amax(dim=-1)[scale != 1] == 127).all()  # each token-head's amax maps to +-127
    assert scale[2, 1] == 1 and (q[2, 1] == 0).all()


def test_kv_int8_ties_round_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5]])
    q, scale = quantize_kv_int8(x)
    assert scale.item() == 1 and q.tolist() == [[127, 1, -1, 2, -3]]
