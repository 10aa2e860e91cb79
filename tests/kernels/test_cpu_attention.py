"""The C++ CPU decode attention (kernels/cpu_attention.py) against the kernels' per-sequence PyTorch reference,
over paged caches whose blocks are handed out in shuffled order; and the torch backend's use of it."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import cpu_attention
from sluice.kernels.cpu_attention import paged_decode_attention_cpu
from sluice.kernels.decode_attention import paged_decode_attention_ref
from sluice.worker.engine import attention
from sluice.worker.engine.attention import AttentionMetadata, LayerCache, TorchAttention

BLOCK = 16
# contexts of one token, of exactly one and several blocks, and across block boundaries
CONTEXTS = [1, 7, 16, 17, 48, 100, 333]

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ toolchain to build the kernel")


def _paged(gen: torch.Generator, contexts: list[int], heads: int, kv_heads: int, dim: int):
    blocks = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(blocks) + 3
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(blocks) + 2, dtype=torch.int32)  # spare columns, as the runner pads
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    return q, k, v, tables, torch.tensor(contexts, dtype=torch.int32)


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (16, 4)], ids=["mha", "gqa4", "gqa4_16"])
def test_matches_the_reference(dim, heads, kv_heads):
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(dim + heads), CONTEXTS, heads, kv_heads, dim)
    out = paged_decode_attention_cpu(q, k, v, tables, ctx, dim ** -0.5)
    want = paged_decode_attention_ref(q, k, v, tables, ctx, dim ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# bfloat16 scores take vdpbf16ps over 16-token tiles where the CPU has AVX512-BF16, for groups of 1-8 query heads
# and head_dim a multiple of 32: every group size of that path, and the general path past it (group 12, dim 16)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (4, 4, 128), (4, 2, 64), (6, 2, 32), (14, 2, 64),
                                                        (16, 2, 256), (10, 2, 64), (12, 2, 64), (24, 2, 64),
                                                        (8, 2, 16)])
def test_half_precision_caches_match_the_float32_reference(dtype, heads, kv_heads, dim):
    """bfloat16/float16 query and cache read in place, float32 inside: within the dtype's rounding of the float32
    reference over the same (rounded) values, and with a sliding window and soft-capping too."""
    if dtype not in cpu_attention.dtypes():
        pytest.skip(f"built without {dtype}")
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(dim + 1), CONTEXTS, heads, kv_heads, dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = paged_decode_attention_cpu(q, k, v, tables, ctx, dim ** -0.5)
    assert out.dtype == dtype
    want = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, ctx, dim ** -0.5)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), want, atol=eps, rtol=eps)  # one rounding of the float32 result
    capped = paged_decode_attention_cpu(q, k, v, tables, ctx, dim ** -0.5, sliding_window=20, softcap=5.0)
    want = paged_decode_attention_cpu(q.float(), k.float(), v.float(), tables, ctx, dim ** -0.5, sliding_window=20,
                                      softcap=5.0)
    torch.testing.assert_close(capped.float(), want, atol=eps, rtol=eps)


def test_the_thread_count_does_not_change_a_bit():
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(3), CONTEXTS * 3, 8, 2, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(paged_decode_attention_cpu(q, k, v, tables, ctx, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_sliding_window_attends_to_the_last_tokens_only():
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(4), CONTEXTS, 8, 2, 32)
    out = paged_decode_attention_cpu(q, k, v, tables, ctx, 32 ** -0.5, sliding_window=20)
    for i, n in enumerate(CONTEXTS):  # the reference over the window alone: the same keys, re-paged from 0
        first = max(0, n - 20)
        pos = torch.arange(first, n)
        rows_k = k[tables[i, pos // BLOCK].long(), pos % BLOCK]
        rows_v = v[tables[i, pos // BLOCK].long(), pos % BLOCK]
        group = 8 // 2
        scores = torch.einsum("hd,nhd->hn", q[i], rows_k.repeat_interleave(group, 1)) * 32 ** -0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), rows_v.repeat_interleave(group, 1))
        torch.testing.assert_close(out[i], want, atol=2e-6, rtol=2e-5)
    assert not torch.allclose(out[-1], paged_decode_attention_ref(q, k, v, tables, ctx, 32 ** -0.5)[-1], atol=1e-3)


def test_writes_into_a_strided_out():
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(5), CONTEXTS, 4, 2, 32)
    out = torch.full((len(CONTEXTS), 4, 64), float("nan"))[:, :, :32]  # not contiguous
    paged_decode_attention_cpu(q, k, v, tables, ctx, 0.2, out=out)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, ctx, 0.2), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {**a, "q": a["q"].double()}, "CPU tensors of one dtype"),
    (lambda a: {**a, "q": a["q"].bfloat16()}, "CPU tensors of one dtype"),  # its cache float32
    (lambda a: {**a, "context_lens": a["context_lens"].long()}, "int32"),
    (lambda a: {**a, "q": a["q"][:, :, :12].contiguous(), "k_cache": a["k_cache"][..., :12].contiguous(),
                "v_cache": a["v_cache"][..., :12].contiguous()}, "head_dim"),
    (lambda a: {**a, "block_tables": a["block_tables"][:-1]}, "must have 7 rows"),
    (lambda a: {**a, "block_tables": a["block_tables"][:, :2].contiguous()}, "333 tokens is longer than"),
])
def test_rejects_what_it_cannot_run(change, message):
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(6), CONTEXTS, 4, 2, 32)
    args = {"q": q, "k_cache": k, "v_cache": v, "block_tables": tables, "context_lens": ctx, "scale": 0.2}
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_cpu(**change(args))


def test_the_torch_backend_takes_it_for_float32_decode_rows_and_agrees_with_gather_and_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "KERNEL_PREFILL_CONTEXT", 0)  # the prompt keeps SDPA here
    contexts = CONTEXTS + [5]  # the decode rows, then one 5-token prompt
    q, k, v, tables, ctx = _paged(torch.Generator().manual_seed(7), contexts, 8, 2, 64)
    q = torch.cat([q[:-1], torch.randn(5, 8, 64, generator=torch.Generator().manual_seed(8))])
    q_lens = [1] * len(CONTEXTS) + [5]
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(q), dtype=torch.int64), block_tables=tables,
                             context_lens=ctx, cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
                             num_decodes=len(CONTEXTS), query_lens=q_lens, context_lens_list=contexts)
    native, gathered = TorchAttention(), TorchAttention(cpu_decode_kernel=False)
    out = native.attend(q, LayerCache(k, v), meta, 0.125)
    want = gathered.attend(q, LayerCache(k, v), meta, 0.125)
    # the kernel took the decode rows (the step has no window)
    assert native._plans[None][1].decodes == [] and len(gathered._plans[None][1].decodes) > 0
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)
    assert torch.equal(out[len(CONTEXTS):], want[len(CONTEXTS):])  # the prefill row went the same way in both
