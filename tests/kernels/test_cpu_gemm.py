"""sluice's CPU GEMM (kernels/cpu_gemm.py) against F.linear in float64, and its gated forms against the projection
followed by the SiLU kernel, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import cpu_gemm, cpu_layers

DTYPES = cpu_gemm.dtypes()
pytestmark = pytest.mark.skipif(not DTYPES, reason="sluice's CPU GEMM needs AVX-512 and a C++ compiler")
# (rows, out_features, in_features): one row, a row count of whole 8-row tiles plus a remainder of each size, N
# not a multiple of the 32-column panel, K odd (float32 only)
SHAPES = [(1, 64, 32), (7, 96, 64), (8, 32, 16), (21, 100, 48), (64, 160, 256), (70, 64, 30), (0, 64, 32)]
# one output rounding in bfloat16 (8 bits); float32 sums of K products
TOL = {torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-4)}


def _case(gen, rows, n, k, dtype, bias):
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_linear_matches_float64(dtype, bias, rows, n, k):
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bfloat16 takes K in pairs")
    x, w, b = _case(torch.Generator().manual_seed(rows * 1000 + n + k), rows, n, k, dtype, bias)
    got = cpu_gemm.linear(x, cpu_gemm.pack(w, b))
    assert got.dtype == dtype and got.shape == (rows, n)
    want = F.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    if rows:  # no worse than PyTorch's own GEMM in this dtype
        ours, theirs = (got.double() - want).abs().max(), (F.linear(x, w, b).double() - want).abs().max()
        assert ours <= 2 * theirs + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_gated_pack_gives_the_same_projection_and_fuses_silu_bit_for_bit(dtype, bias):
    """[gate; up] packed gated: the plain output in its natural column order, equal to the plain pack's; and
    silu(gate) * up from the same pass, equal to the SiLU kernel run on that output."""
    x, w, b = _case(torch.Generator().manual_seed(3), 19, 2 * 48, 64, dtype, bias)
    plain = cpu_gemm.linear(x, cpu_gemm.pack(w, b))
    gated = cpu_gemm.pack(w, b, gated=True)
    assert torch.equal(cpu_gemm.linear(x, gated), plain)
    fused = cpu_gemm.linear_silu_and_mul(x, gated)
    assert fused.shape == (19, 48)
    assert torch.equal(fused, cpu_layers.silu_and_mul(plain))
    gate, up = F.linear(x.double(), w.double(), b.double() if bias else None).chunk(2, dim=-1)
    torch.testing.assert_close(fused.double(), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_result_does_not_depend_on_the_thread_count(dtype):
    x, w, _ = _case(torch.Generator().manual_seed(4), 33, 256, 128, dtype, False)
    packed = cpu_gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, cpu_gemm.linear(x, packed))


def test_bad_inputs_are_named():
    dtype = DTYPES[0]
    w = torch.randn(64, 32).to(dtype)
    packed = cpu_gemm.pack(w)
    with pytest.raises(ValueError, match=r"x must be a CPU \[M, 32\]"):
        cpu_gemm.linear(torch.randn(4, 31).to(dtype), packed)
    with pytest.raises(ValueError, match=r"x must be a CPU \[M, 32\]"):
        cpu_gemm.linear(torch.randn(4, 32, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="cpu_gemm.pack: a CPU weight"):
        cpu_gemm.pack(torch.randn(64, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="N a multiple of 32 when gated"):
        cpu_gemm.pack(torch.randn(48, 32).to(dtype), gated=True)
    with pytest.raises(ValueError, match="not packed gated"):
        cpu_gemm.linear_silu_and_mul(torch.randn(4, 32).to(dtype), packed)
    if torch.bfloat16 in DTYPES:
        assert not cpu_gemm.supports(torch.randn(64, 31, dtype=torch.bfloat16))  # K in pairs
