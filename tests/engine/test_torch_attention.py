"""The pure-PyTorch backend's whole step (decode buckets, short prefills padded together, long prefills alone)
against the kernels' per-sequence reference, over a paged cache whose blocks are handed out in shuffled order."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.prefill_attention import paged_prefill_attention_ref
from sluice.kernels.quant import quantize_kv_int8
from sluice.worker.engine import attention
from sluice.worker.engine.attention import AttentionMetadata, LayerCache, TorchAttention

BLOCK, KV_HEADS, HEADS, DIM = 16, 2, 8, 32
# (query tokens, context after the step), decodes first as the model runner orders them: two decodes, a whole
# short prompt, a short chunk after a cached prefix, a 64-token chunk after a long prefix, a prompt longer than
# SHORT_PREFILL, and two short prompts of the same length (one bucket pads none of them)
ROWS = [(1, 9), (1, 40), (5, 5), (3, 40), (64, 200), (70, 70), (20, 20), (20, 20)]


def _step(gen: torch.Generator, int8: bool):
    blocks = [-(-ctx // BLOCK) for _, ctx in ROWS]
    num_blocks = sum(blocks) + 3
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    cache = LayerCache(k, v)
    if int8:
        (k, k_scale), (v, v_scale) = quantize_kv_int8(k), quantize_kv_int8(v)
        cache = LayerCache(k, v, k_scale, v_scale)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(ROWS), max(blocks) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q_lens = [n for n, _ in ROWS]
    ctx = [c for _, c in ROWS]
    meta = AttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), block_tables=tables,
                             context_lens=torch.tensor(ctx, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
                             num_decodes=sum(n == 1 for n in q_lens), query_lens=q_lens, context_lens_list=ctx)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen)
    return q, cache, meta


@pytest.mark.parametrize("int8", [False, True], ids=["float_cache", "int8_cache"])
@pytest.mark.parametrize("short", [attention.SHORT_PREFILL, 0], ids=["short_buckets", "every_prefill_alone"])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu_decode_kernel", "decode_buckets"])
def test_a_whole_step_matches_the_reference(monkeypatch, int8, short, cpu_kernel):
    monkeypatch.setattr(attention, "SHORT_PREFILL", short)
    monkeypatch.setattr(attention, "KERNEL_PREFILL_CONTEXT", 0)  # the kernel takes the decode rows only
    q, cache, meta = _step(torch.Generator().manual_seed(0), int8)
    backend = TorchAttention(cpu_decode_kernel=cpu_kernel)
    out = backend.attend(q, cache, meta, DIM ** -0.5)
    want = paged_prefill_attention_ref(q, cache.k, cache.v, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                       DIM ** -0.5, k_scale=cache.k_scale, v_scale=cache.v_scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    plan = backend._plans[None][1]  # the step has no window
    padded = [b.table.shape[0] for b in plan.short_prefills]
    if short:  # the five prefill rows of at most 64 tokens went into buckets (all five in one, here), the 70 alone
        assert sum(padded) == 5 and len(plan.prefills) == 1
    else:
        assert padded == [] and len(plan.prefills) == 6


def test_a_sliding_window_masks_the_same_keys_in_buckets_as_alone(monkeypatch):
    q, cache, meta = _step(torch.Generator().manual_seed(1), False)
    meta.sliding_window = 12
    outs = []
    # decode rows by the kernel, prefill rows bucketed; then every row by the kernel; then no kernel, no buckets
    for short, kernel_prefill, cpu_kernel in ((attention.SHORT_PREFILL, 0, True), (0, 1000, True), (0, 0, False)):
        monkeypatch.setattr(attention, "SHORT_PREFILL", short)
        monkeypatch.setattr(attention, "KERNEL_PREFILL_CONTEXT", kernel_prefill)
        outs.append(TorchAttention(cpu_decode_kernel=cpu_kernel).attend(q, cache, meta, DIM ** -0.5))
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], atol=1e-5, rtol=1e-5)
    meta.sliding_window = None  # and the window did change the output
    assert not torch.allclose(outs[0], TorchAttention().attend(q, cache, meta, DIM ** -0.5), atol=1e-3)


@pytest.mark.parametrize("limit", [40, 1000], ids=["short_contexts", "every_row"])
def test_the_cpu_kernel_takes_short_context_prefill_rows_token_by_token(monkeypatch, limit):
    """Prefill rows whose context fits KERNEL_PREFILL_CONTEXT go to the C++ kernel as one row per query token over
    its causal prefix (whole prompts and chunks after a cached prefix alike); the rest keep SDPA. Either way, the
    step's output is the reference's."""
    monkeypatch.setattr(attention, "KERNEL_PREFILL_CONTEXT", limit)
    q, cache, meta = _step(torch.Generator().manual_seed(2), False)
    backend = TorchAttention()
    out = backend.attend(q, cache, meta, DIM ** -0.5)
    want = paged_prefill_attention_ref(q, cache.k, cache.v, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                       DIM ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    plan = backend._plans[None][1]
    taken = [i for i, (n, ctx) in enumerate(ROWS) if n == 1 or ctx <= limit]
    starts = meta.cu_seqlens_q.tolist()
    tokens = [t for i in taken for t in range(starts[i], starts[i + 1])]
    got = plan.kernel.tokens
    assert (list(range(len(q))[got]) if isinstance(got, slice) else got.tolist()) == tokens
    # each token attends its own prefix: the keys before it and itself
    assert plan.kernel.context_lens.tolist() == [c for i in taken for c in range(ROWS[i][1] - ROWS[i][0] + 1,
                                                                                 ROWS[i][1] + 1)]
    assert len(plan.prefills) + sum(b.table.shape[0] for b in plan.short_prefills) == len(ROWS) - len(taken)
