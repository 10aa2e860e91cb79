"""Paged prefill attention against its reference, and the reference against causal SDPA on a prefix + new split."""

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE, assert_close, gather_context, make_paged_kv, nan_like, strided_copy

from sluice.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

# (new query tokens, context length including them): a short prompt, one crossing the 64-row query blocks,
# a chunk after a cached prefix, a single token, and a prefix-cache hit spanning many blocks.
SEQS = [(5, 5), (70, 70), (3, 40), (1, 17), (64, 200)]


def _case(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, int8=False):
    q_lens, context_lens = zip(*seqs)
    k_cache, v_cache, k_scale, v_scale, block_tables = make_paged_kv(
        gen, context_lens, block_size, num_kv_heads, head_dim, dtype, int8
    )
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    cu_seqlens = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, head_dim**-0.5)
    return args, dict(k_scale=k_scale, v_scale=v_scale)


def _check(args, kwargs):
    q = args[0]
    out = paged_prefill_attention(*args, **kwargs, out=nan_like(q.shape, q.dtype))
    assert_close(out, paged_prefill_attention_ref(*args, **kwargs))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 1), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_prefill_matches_reference(gen, dot_dtype, num_heads, num_kv_heads):
    args, kwargs = _case(gen, SEQS, num_heads, num_kv_heads, 32, 16, dot_dtype)
    _check(args, kwargs)


@pytest.mark.parametrize("head_dim, block_size", [(24, 5), (64, 32)])
def test_prefill_odd_head_dim_and_block_size(gen, head_dim, block_size):
    args, kwargs = _case(gen, [(9, 30), (66, 66)], 4, 2, head_dim, block_size, torch.float16)
    _check(args, kwargs)


def test_prefill_int8_kv(gen):
    args, kwargs = _case(gen, SEQS, 4, 1, 32, 16, torch.float16, int8=True)
    _check(args, kwargs)


def test_prefill_strided_index_tensors(gen):
    """block_tables, cu_seqlens_q and context_lens as strided views are read by value (they were read as packed)."""
    args, kwargs = _case(gen, [(5, 5), (20, 40), (33, 33)], 4, 2, 32, 8, torch.float32)
    want = paged_prefill_attention_ref(*args, **kwargs)
    q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale = args
    strided = [strided_copy(t) for t in (block_tables, cu_seqlens, context_lens)]
    assert not any(t.is_contiguous() for t in strided)
    assert_close(paged_prefill_attention(q, k_cache, v_cache, *strided, scale, **kwargs), want)


@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
def test_prefill_reference_matches_causal_sdpa(gen, int8):
    """Prefix + new tokens: the new rows of full causal attention over the whole sequence."""
    (q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale), kw = _case(
        gen, SEQS, 8, 2, 32, 16, torch.float32, int8
    )
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale, **kw)
    for i, n in enumerate(context_lens.tolist()):
        start, end = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        k = gather_context(k_cache, kw["k_scale"], block_tables[i], n).transpose(0, 1)  # [kv_heads, n, dim]
        v = gather_context(v_cache, kw["v_scale"], block_tables[i], n).transpose(0, 1)
        # The cached prefix's queries are unknown here, so pad them with noise: causality keeps them out of
        # the new rows, which are all that is compared.
        prefix_q = torch.randn(n - (end - start), *q.shape[1:], generator=gen, device=DEVICE)
        full_q = torch.cat([prefix_q, q[start:end]]).transpose(0, 1)
        want = F.scaled_dot_product_attention(full_q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        torch.testing.assert_close(ref[start:end], want.transpose(0, 1)[n - (end - start) :], atol=1e-5, rtol=1e-5)


def test_prefill_errors_name_the_field(gen):
    (q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale), kw = _case(
        gen, [(2, 5)], 4, 2, 16, 16, torch.float32
    )
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens[:1], context_lens, scale)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        paged_prefill_attention(q, k_cache, v_cache[..., :8], block_tables, cu_seqlens, context_lens, scale)
