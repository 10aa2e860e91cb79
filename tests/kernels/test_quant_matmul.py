"""W8A16 and W4A16 matmuls against their references, and the references against the unquantized product."""

import pytest
import torch
from kernel_test_utils import DEVICE, assert_close, nan_like, strided_copy

from sluice.kernels.quant import quantize_int4, quantize_int8
from sluice.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
from sluice.kernels.w8a16 import w8a16_matmul, w8a16_matmul_ref

# Each band of the tile table (M <= 16, <= 32, <= 64, larger), none a multiple of its BLOCK_M.
MS = [1, 5, 20, 33, 130]


def _operands(gen, m, n, k, dtype):
    # Scaled so outputs are O(1), where the dtype tolerances are stated.
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5
    return x, w


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", [(48, 256), (100, 320)], ids=["even_k", "ragged_nk"])
def test_w8a16_matches_reference(gen, dot_dtype, m, n, k):
    x, w = _operands(gen, m, n, k, dot_dtype)
    qweight, scale = quantize_int8(w.to(dot_dtype))
    out = w8a16_matmul(x, qweight, scale, out=nan_like((m, n), dot_dtype))
    assert_close(out, w8a16_matmul_ref(x, qweight, scale))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("group_size, k", [(32, 96), (64, 384), (128, 256)])
def test_w4a16_matches_reference(gen, dot_dtype, m, group_size, k):
    x, w = _operands(gen, m, 72, k, dot_dtype)
    qweight, scales, zeros = quantize_int4(w.to(dot_dtype), group_size)
    out = w4a16_matmul(x, qweight, scales, zeros, group_size, out=nan_like((m, 72), dot_dtype))
    assert_close(out, w4a16_matmul_ref(x, qweight, scales, zeros, group_size))


def test_strided_activations(gen):
    """x as a column slice of a wider tensor (row stride != K)."""
    wide = torch.randn(9, 400, generator=gen, device=DEVICE)
    x = wide[:, 16:272]
    _, w = _operands(gen, 9, 40, 256, torch.float32)
    qweight, scale = quantize_int8(w)
    assert_close(w8a16_matmul(x, qweight, scale), w8a16_matmul_ref(x, qweight, scale))
    qweight, scales, zeros = quantize_int4(w, 64)
    assert_close(w4a16_matmul(x, qweight, scales, zeros, 64), w4a16_matmul_ref(x, qweight, scales, zeros, 64))


def test_strided_weights_and_scales(gen):
    """Quantized weights and their scales as strided views are read by value (w8a16 read its scale as packed)."""
    x, w = _operands(gen, 5, 40, 256, torch.float32)
    qweight, scale = quantize_int8(w)
    want = x @ (qweight.float() * scale[:, None]).T
    assert_close(w8a16_matmul(x, strided_copy(qweight), strided_copy(scale)), want)
    qweight, scales, zeros = quantize_int4(w, 64)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, 64)
    assert_close(w4a16_matmul(x, strided_copy(qweight), strided_copy(scales), strided_copy(zeros), 64), want)


def test_references_stay_within_quantization_error(gen):
    """Each weight is off by at most half its step, so |y - x @ w.T| <= sum_k |x_k| * step_k / 2."""
    x, w = _operands(gen, 6, 24, 128, torch.float32)
    exact = x @ w.T
    qweight, scale = quantize_int8(w)
    bound = x.abs() @ (scale[:, None] / 2).expand(-1, 128).T
    assert ((w8a16_matmul_ref(x, qweight, scale) - exact).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    qweight, scales, zeros = quantize_int4(w, 32)
    bound = x.abs() @ (scales / 2).repeat_interleave(32, dim=1).T
    assert ((w4a16_matmul_ref(x, qweight, scales, zeros, 32) - exact).abs() <= bound * (1 + 1e-4) + 1e-6).all()


def test_shape_errors_name_the_field():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="qweight"):
        w8a16_matmul(x, torch.zeros(8, 32, dtype=torch.int8, device=DEVICE), torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, torch.zeros(8, 32, dtype=torch.uint8, device=DEVICE), torch.ones(8, 2, device=DEVICE),
                     torch.ones(8, 2, device=DEVICE), 48)
