"""Sliding windows and soft-capped scores (Gemma 2) in the paged attention kernels: the Triton decode and prefill
kernels against their PyTorch references, and the references against the engine's torch backend (gather + SDPA or
its soft-capped math, and the C++ CPU decode kernel)."""

import pytest
import torch
from kernel_test_utils import DEVICE, assert_close, make_paged_kv, nan_like

from sluice.kernels import cpu_attention
from sluice.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from sluice.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from sluice.worker.engine import attention
from sluice.worker.engine.attention import AttentionMetadata, LayerCache, TorchAttention

SCALE = 0.5  # with head_dim 16 and unit-normal q and k, scores of about +-2: a cap of 1.5 bites
SOFTCAP = 1.5
# (window, softcap): each alone and both; windows shorter than a 64-key step and longer (150: three decode splits)
MASKING = [(None, SOFTCAP), (20, None), (20, SOFTCAP), (150, SOFTCAP)]
DECODE_CONTEXTS = [1, 7, 20, 21, 150, 300]
# (new query tokens, context): whole prompts inside and past the window, chunks after a cached prefix, a prompt of
# more than one 64-row query block
PREFILL_SEQS = [(5, 5), (30, 30), (3, 40), (1, 17), (70, 200)]


def _decode_case(gen, dtype=torch.float32):
    k, v, _, _, tables = make_paged_kv(gen, DECODE_CONTEXTS, 16, 2, 16, dtype)
    q = torch.randn(len(DECODE_CONTEXTS), 8, 16, generator=gen, device=DEVICE).to(dtype)
    return q, k, v, tables, torch.tensor(DECODE_CONTEXTS, dtype=torch.int32, device=DEVICE)


def _prefill_case(gen, seqs, dtype=torch.float32):
    q_lens, contexts = zip(*seqs)
    k, v, _, _, tables = make_paged_kv(gen, contexts, 16, 2, 16, dtype)
    q = torch.randn(sum(q_lens), 8, 16, generator=gen, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    return q, k, v, tables, cu, torch.tensor(contexts, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(("window", "softcap"), MASKING)
@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "split3"])
def test_decode_kernel_matches_reference(gen, window, softcap, num_splits):
    q, k, v, tables, ctx = _decode_case(gen)
    masking = dict(sliding_window=window, softcap=softcap)
    out = paged_decode_attention(q, k, v, tables, ctx, SCALE, out=nan_like(q.shape, q.dtype), num_splits=num_splits,
                                 **masking)
    assert_close(out, paged_decode_attention_ref(q, k, v, tables, ctx, SCALE, **masking))


@pytest.mark.parametrize(("window", "softcap"), MASKING)
def test_prefill_kernel_matches_reference(gen, window, softcap):
    q, k, v, tables, cu, ctx = _prefill_case(gen, PREFILL_SEQS)
    masking = dict(sliding_window=window, softcap=softcap)
    out = paged_prefill_attention(q, k, v, tables, cu, ctx, SCALE, out=nan_like(q.shape, q.dtype), **masking)
    assert_close(out, paged_prefill_attention_ref(q, k, v, tables, cu, ctx, SCALE, **masking))


def test_half_precision_kernels_soft_cap_too(gen):
    q, k, v, tables, ctx = _decode_case(gen, torch.float16)
    masking = dict(sliding_window=20, softcap=SOFTCAP)
    assert_close(paged_decode_attention(q, k, v, tables, ctx, SCALE, **masking),
                 paged_decode_attention_ref(q, k, v, tables, ctx, SCALE, **masking))
    q, k, v, tables, cu, ctx = _prefill_case(gen, PREFILL_SEQS, torch.float16)
    assert_close(paged_prefill_attention(q, k, v, tables, cu, ctx, SCALE, **masking),
                 paged_prefill_attention_ref(q, k, v, tables, cu, ctx, SCALE, **masking))


def test_the_references_mask_and_cap(gen):
    """What the kernels are checked against changes with each option (a reference that ignored one would pass)."""
    q, k, v, tables, ctx = _decode_case(gen)
    plain = paged_decode_attention_ref(q, k, v, tables, ctx, SCALE)
    for masking in ({"softcap": SOFTCAP}, {"sliding_window": 20}):
        changed = paged_decode_attention_ref(q, k, v, tables, ctx, SCALE, **masking)
        assert (changed - plain).abs().max() > 1e-2, masking
    q, k, v, tables, cu, ctx = _prefill_case(gen, PREFILL_SEQS)
    plain = paged_prefill_attention_ref(q, k, v, tables, cu, ctx, SCALE)
    for masking in ({"softcap": SOFTCAP}, {"sliding_window": 20}):
        changed = paged_prefill_attention_ref(q, k, v, tables, cu, ctx, SCALE, **masking)
        assert (changed - plain).abs().max() > 1e-2, masking


@pytest.mark.parametrize(("window", "softcap"), MASKING)
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["gathered", "cpu_kernel"])
def test_torch_backend_matches_the_references(monkeypatch, gen, window, softcap, cpu_kernel):
    """One step of decode rows, short prefills (bucketed) and a long one (alone), as the engine attends it; then
    with the kernel taking the prefill rows too."""
    if cpu_kernel and (DEVICE != "cpu" or not cpu_attention.available()):
        pytest.skip("the C++ decode kernel runs float32 on the CPU only")
    seqs = [(1, n) for n in DECODE_CONTEXTS] + PREFILL_SEQS
    q, k, v, tables, cu, ctx = _prefill_case(gen, seqs)
    nd = len(DECODE_CONTEXTS)
    q_lens, contexts = (list(x) for x in zip(*seqs))
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.int64, device=DEVICE), block_tables=tables,
                             context_lens=ctx, cu_seqlens_q=cu, num_decodes=nd, query_lens=q_lens,
                             context_lens_list=contexts, sliding_window=window)
    masking = dict(sliding_window=window, softcap=softcap)
    want_decode = paged_decode_attention_ref(q[:nd], k, v, tables[:nd], ctx[:nd], SCALE, **masking)
    want_prefill = paged_prefill_attention_ref(q[nd:], k, v, tables[nd:], cu[nd:] - nd, ctx[nd:], SCALE, **masking)
    for kernel_prefill in (0, 10_000) if cpu_kernel else (0,):
        monkeypatch.setattr(attention, "KERNEL_PREFILL_CONTEXT", kernel_prefill)
        backend = TorchAttention(cpu_decode_kernel=cpu_kernel)
        out = backend.attend(q, LayerCache(k, v), meta, SCALE, softcap)
        plan = backend._plans[window][1]
        assert (plan.kernel is not None) == cpu_kernel
        if kernel_prefill:  # every row went to the kernel
            assert not plan.prefills and not plan.short_prefills and plan.kernel.tokens == slice(0, len(q))
        else:
            assert plan.prefills and plan.short_prefills  # every path ran
        torch.testing.assert_close(out[:nd], want_decode, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out[nd:], want_prefill, atol=2e-5, rtol=2e-5)
