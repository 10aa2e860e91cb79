"""Paged decode attention against its reference, and the reference against SDPA over gathered K/V."""

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE, assert_close, gather_context, make_paged_kv, nan_like, strided_copy

from sluice.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

# Shorter than a block, exactly one, one past, and many blocks (several 64-token kernel steps).
CONTEXT_LENS = [1, 7, 16, 17, 150]


def _case(gen, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, int8=False):
    k_cache, v_cache, k_scale, v_scale, block_tables = make_paged_kv(
        gen, context_lens, block_size, num_kv_heads, head_dim, dtype, int8
    )
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return (q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5), dict(k_scale=k_scale, v_scale=v_scale)


def _check(args, kwargs, **options):
    q = args[0]
    out = paged_decode_attention(*args, **kwargs, out=nan_like(q.shape, q.dtype), **options)
    assert_close(out, paged_decode_attention_ref(*args, **kwargs))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "split3"])
def test_decode_matches_reference(gen, dot_dtype, num_heads, num_kv_heads, num_splits):
    args, kwargs = _case(gen, CONTEXT_LENS, num_heads, num_kv_heads, 32, 16, dot_dtype)
    _check(args, kwargs, num_splits=num_splits)


@pytest.mark.parametrize("head_dim, block_size", [(24, 5), (64, 32)])
def test_decode_odd_head_dim_and_block_size(gen, head_dim, block_size):
    args, kwargs = _case(gen, [3, 40, 77], 6, 2, head_dim, block_size, torch.float16)
    _check(args, kwargs, num_splits=2)


@pytest.mark.parametrize("num_splits", [None, 2], ids=["auto", "split2"])
def test_decode_int8_kv(gen, num_splits):
    args, kwargs = _case(gen, CONTEXT_LENS, 8, 2, 32, 16, torch.float16, int8=True)
    _check(args, kwargs, num_splits=num_splits)


def test_decode_long_context_default_splits(gen):
    """A table wider than one partition takes the split path without being told (1100 tokens -> 3 splits)."""
    args, kwargs = _case(gen, [1100, 9], 4, 1, 16, 32, torch.float32)
    _check(args, kwargs)


def test_decode_strided_block_tables_and_context_lens(gen):
    """Index tensors as strided views are read by value (the kernel had read them as if packed)."""
    (q, k_cache, v_cache, block_tables, context_lens, scale), kw = _case(gen, [5, 20, 33], 4, 2, 32, 8, torch.float32)
    want = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, **kw)
    tables, lens = strided_copy(block_tables), strided_copy(context_lens)
    assert not tables.is_contiguous() and not lens.is_contiguous()
    for num_splits in (None, 2):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, **kw, num_splits=num_splits)
        assert_close(out, want)


@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
def test_decode_reference_matches_sdpa(gen, int8):
    (q, k_cache, v_cache, block_tables, context_lens, scale), kw = _case(
        gen, CONTEXT_LENS, 8, 2, 32, 16, torch.float32, int8
    )
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, **kw)
    for i, n in enumerate(context_lens.tolist()):
        k = gather_context(k_cache, kw["k_scale"], block_tables[i], n).transpose(0, 1)  # [kv_heads, n, dim]
        v = gather_context(v_cache, kw["v_scale"], block_tables[i], n).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale, enable_gqa=True)[:, 0]
        torch.testing.assert_close(ref[i], want, atol=1e-5, rtol=1e-5)


def test_decode_errors_name_the_field(gen):
    (q, k_cache, v_cache, block_tables, context_lens, scale), kw = _case(gen, [5], 4, 2, 16, 16, torch.float32, True)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    with pytest.raises(ValueError, match="num_heads=3"):
        paged_decode_attention_ref(q[:, :3], k_cache, v_cache, block_tables, context_lens, scale, **kw)
