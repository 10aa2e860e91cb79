"""Attention over the paged KV cache: step metadata, the backend interface and its pure-PyTorch backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from sluice.kernels import cpu_attention
from sluice.kernels.quant import dequantize_kv_int8, quantize_kv_int8


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Rows are sequences; the first `num_decodes` have exactly one query token. Tokens are packed
    sequence after sequence, with no padding.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int
    query_lens: list[int]
    context_lens_list: list[int]
    sliding_window: int | None = None


@dataclass
class LayerCache:
    """One layer's K and V cache, [num_blocks, block_size, num_kv_heads, head_dim]; with an INT8 cache, the
    per-token-and-head scales [num_blocks, block_size, num_kv_heads] in float32."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class AttentionBackend(Protocol):
    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """softmax(scores) v with scores = q k^T * scale, or softcap * tanh(that / softcap) (Gemma 2), masked causally
        and to meta.sliding_window."""


# Decode rows attended together: at least DECODE_BUCKET, more while the bucket's gathered K and V stay within
# BUCKET_BYTES. Rows arrive sorted by context, so a bucket pads little. Small buckets keep what SDPA reads in cache;
# short contexts of a small model fit many rows in that, and fewer, larger buckets save the per-call cost of two ops
# per bucket and layer (the measurements are in bench/NOTES.md).
DECODE_BUCKET = 8
BUCKET_BYTES = 2 << 20
# Prefill rows of at most this many query tokens are attended together, padded to their bucket's longest (a
# stream of short prompts otherwise costs a gather and an SDPA call per prompt and layer); longer rows run alone.
SHORT_PREFILL = 64
# With the C++ kernel, a prefill row whose context is at most this many tokens goes to it too, each query token as
# a decode row over its own causal prefix (the same keys SDPA's causal mask leaves it): one call for the step's
# decode and short prefill rows instead of a gather and an SDPA call per row and layer. Longer contexts are faster
# through SDPA's blocked kernel, which reads each key once per block of queries rather than once per query.
KERNEL_PREFILL_CONTEXT = 256


@dataclass
class DecodeBucket:
    rows: slice
    table: torch.Tensor  # [rows, blocks]: the blocks the bucket's longest context spans
    bias: torch.Tensor  # [rows, 1, 1, blocks * block_size]: 0 where a row attends, -inf over padding


@dataclass
class PrefillRow:
    tokens: slice  # the row's query tokens in the step
    context: int  # tokens in the cache after this step
    table: torch.Tensor  # [1, blocks]
    mask: torch.Tensor | None  # [query, context] bool; None: plain causal (the whole context is this chunk)


@dataclass
class PrefillBucket:
    """Short prefill rows padded to `width` query tokens: token src[i] of the step is padded row slot dst[i]."""

    src: torch.Tensor  # [tokens] int64: the bucket's query tokens in the step
    dst: torch.Tensor  # [tokens] int64: their places in [rows * width]
    width: int
    table: torch.Tensor  # [rows, blocks]
    bias: torch.Tensor  # [rows, 1, width, blocks * block_size]: 0 where a query attends, -inf elsewhere


@dataclass
class KernelRows:
    """The query tokens the C++ kernel attends this step, each one row over its own context."""

    tokens: slice | torch.Tensor  # the tokens of the step it takes: a leading slice, or int64 indices
    tables: torch.Tensor  # [rows, max_blocks] int32: each token's sequence's block table
    context_lens: torch.Tensor  # [rows] int32: keys each token attends (its position + 1)


@dataclass
class StepPlan:
    """What every layer attends over this step, derived once from the metadata instead of once per layer."""

    decodes: list[DecodeBucket]
    prefills: list[PrefillRow]
    short_prefills: list[PrefillBucket]
    kernel: KernelRows | None = None  # the decode rows (and short prefill rows) for the C++ kernel


class TorchAttention:
    """Reference backend in plain PyTorch, for CPU and CUDA: gathers each sequence's blocks, then SDPA. Decode rows
    on the CPU (float32, bfloat16, float16 caches) go to the C++ kernel that reads the blocks in place
    (kernels/cpu_attention.py), unless `cpu_decode_kernel` is False or it cannot be built."""

    def __init__(self, cpu_decode_kernel: bool = True):
        self.cpu_decode_kernel = cpu_decode_kernel
        self._plans: dict[int | None, tuple[AttentionMetadata, StepPlan]] = {}  # by window: the step it planned

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build the C++ kernel now if this engine will use it (a compile the first time on a machine, then cached),
        rather than inside the first decode step."""
        if self.cpu_decode_kernel and device.type == "cpu":
            cpu_attention.available()

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
        if cache.k_scale is not None:
            k, k_scale = quantize_kv_int8(k)
            v, v_scale = quantize_kv_int8(v)
            cache.k_scale.view(-1, k_scale.shape[-1]).index_copy_(0, meta.slot_mapping, k_scale)
            cache.v_scale.view(-1, v_scale.shape[-1]).index_copy_(0, meta.slot_mapping, v_scale)
        nb, bs, h, d = cache.k.shape
        cache.k.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(nb * bs, h, d).index_copy_(0, meta.slot_mapping, v)

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        plan = self._step_plan(meta, cache, q)
        out = torch.empty_like(q)
        if (rows := plan.kernel) is not None:
            whole = isinstance(rows.tokens, slice)
            kq = q[rows.tokens] if whole else q.index_select(0, rows.tokens)
            kout = out[rows.tokens] if whole else torch.empty_like(kq)
            cpu_attention.paged_decode_attention_cpu(kq, cache.k, cache.v, rows.tables, rows.context_lens, scale,
                                                     meta.sliding_window, kout, softcap)
            if not whole:
                out.index_copy_(0, rows.tokens, kout)
        for b in plan.decodes:
            out[b.rows] = self._decode(q[b.rows], cache, b, scale, softcap)
        for p in plan.prefills:
            out[p.tokens] = self._prefill(q[p.tokens], cache, p, scale, softcap)
        for b in plan.short_prefills:
            out[b.src] = self._short_prefill(q, cache, b, scale, softcap)
        return out

    def _native(self, q: torch.Tensor, cache: LayerCache) -> bool:
        return (self.cpu_decode_kernel and cache.k_scale is None and cpu_attention.supports(q, cache.k)
                and cpu_attention.available())

    def _step_plan(self, meta: AttentionMetadata, cache: LayerCache, q: torch.Tensor) -> StepPlan:
        # one plan per window and step: layers of one window share it (Qwen2 may mix windowed and full layers)
        plan = self._plans.get(meta.sliding_window)
        if plan is None or plan[0] is not meta:  # a new step: the window's first layer builds it
            dtype, native = q.dtype, self._native(q, cache)
            _, block_size, kv_heads, head_dim = cache.k.shape
            token_bytes = 2 * kv_heads * head_dim * dtype.itemsize  # K and V, as gathered
            prefill = range(meta.num_decodes, len(meta.query_lens))
            to_kernel = [i for i in prefill if meta.context_lens_list[i] <= KERNEL_PREFILL_CONTEXT] if native else []
            rest = set(prefill) - set(to_kernel)
            short = [i for i in sorted(rest) if meta.query_lens[i] <= SHORT_PREFILL]
            decodes = [] if native else _decode_buckets(meta, block_size, token_bytes, dtype)
            rows = [*range(meta.num_decodes), *to_kernel] if native else []
            kernel = _kernel_rows(meta, rows) if rows else None
            plan = self._plans[meta.sliding_window] = (meta, StepPlan(
                decodes, _prefill_rows(meta, block_size, set(short) | set(to_kernel)),
                _short_prefill_buckets(meta, short, block_size, token_bytes, dtype), kernel))
        return plan[1]

    def _decode(self, q: torch.Tensor, cache: LayerCache, b: DecodeBucket, scale: float,
                softcap: float | None) -> torch.Tensor:
        n, heads, d = q.shape
        kv_heads = cache.k.shape[2]
        k, v = _gather(cache, b.table, q.dtype)  # [n, kv_heads, L, d]
        # each KV head's group of query heads forms its query rows: GQA without repeating K/V
        out = _sdpa(q.view(n, kv_heads, heads // kv_heads, d), k, v, b.bias, scale, softcap)
        return out.reshape(n, heads, d)

    def _short_prefill(self, q: torch.Tensor, cache: LayerCache, b: PrefillBucket, scale: float,
                       softcap: float | None) -> torch.Tensor:
        rows, heads, d = b.table.shape[0], q.shape[1], q.shape[2]
        padded = q.new_zeros(rows * b.width, heads, d)
        padded[b.dst] = q[b.src]
        k, v = _gather(cache, b.table, q.dtype)
        out = _sdpa(padded.view(rows, b.width, heads, d).transpose(1, 2), k, v, b.bias, scale, softcap,
                    enable_gqa=True)
        return out.transpose(1, 2).reshape(rows * b.width, heads, d)[b.dst]

    def _prefill(self, q: torch.Tensor, cache: LayerCache, p: PrefillRow, scale: float,
                 softcap: float | None) -> torch.Tensor:
        k, v = _gather(cache, p.table, q.dtype)
        k, v = k[:, :, :p.context], v[:, :, :p.context]
        out = _sdpa(q.transpose(0, 1).unsqueeze(0), k, v, p.mask, scale, softcap, is_causal=p.mask is None,
                    enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float | None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA, or with `softcap` its math spelled out (SDPA cannot cap the scores)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return softcapped_attention(q, k, v, mask, scale, softcap, is_causal)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         softcap: float, is_causal: bool = False) -> torch.Tensor:
    """Attention over soft-capped scores in transformers' eager order (scale, cap, mask, float32 softmax): q [...,
    heads, Lq, d], k and v [..., kv_heads, Lk, d]; `mask` boolean (True: attend) or additive; is_causal aligns the
    queries to the keys' start, as SDPA's does."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def bucket_ends(context_lens: list[int], block_size: int, token_bytes: int) -> list[int]:
    """Where each decode bucket ends, over rows sorted by context: DECODE_BUCKET rows, or more while the bucket's
    K and V (rows x its longest context, in whole blocks) stay within BUCKET_BYTES."""
    row_bytes = [-(-c // block_size) * block_size * token_bytes for c in context_lens]
    ends, start, n = [], 0, len(context_lens)
    while start < n:
        end = min(start + DECODE_BUCKET, n)
        while end < n and (end + 1 - start) * row_bytes[end] <= BUCKET_BYTES:
            end += 1
        ends.append(end)
        start = end
    return ends


def _decode_buckets(meta: AttentionMetadata, block_size: int, token_bytes: int,
                    dtype: torch.dtype) -> list[DecodeBucket]:
    buckets, start = [], 0
    for end in bucket_ends(meta.context_lens_list[:meta.num_decodes], block_size, token_bytes):
        rows, start = slice(start, end), end
        ctx = meta.context_lens[rows]
        blocks = -(-max(meta.context_lens_list[rows]) // block_size)
        pos = torch.arange(blocks * block_size, device=ctx.device)
        keep = pos[None, :] < ctx[:, None]
        if meta.sliding_window is not None:
            keep &= pos[None, :] > (ctx[:, None] - 1 - meta.sliding_window)
        # an additive mask: SDPA would otherwise convert a boolean one in every layer
        bias = torch.zeros(keep.shape, dtype=dtype, device=ctx.device).masked_fill_(~keep, float("-inf"))
        buckets.append(DecodeBucket(rows, meta.block_tables[rows, :blocks], bias[:, None, None, :]))
    return buckets


def _short_prefill_buckets(meta: AttentionMetadata, short: list[int], block_size: int, token_bytes: int,
                           dtype: torch.dtype) -> list[PrefillBucket]:
    """Buckets of the short prefill rows `short`, by context as decode buckets are (the same byte budget)."""
    short = sorted(short, key=lambda i: meta.context_lens_list[i])
    starts = meta.cu_seqlens_q.tolist()
    buckets, first = [], 0
    for end in bucket_ends([meta.context_lens_list[i] for i in short], block_size, token_bytes):
        rows, first = short[first:end], end
        buckets.append(_short_prefill_bucket(meta, rows, starts, block_size, dtype))
    return buckets


def _short_prefill_bucket(meta: AttentionMetadata, rows: list[int], starts: list[int], block_size: int,
                          dtype: torch.dtype) -> PrefillBucket:
    dev = meta.context_lens.device
    width = max(meta.query_lens[i] for i in rows)
    src, dst = [], []
    for r, i in enumerate(rows):
        src += range(starts[i], starts[i] + meta.query_lens[i])
        dst += range(r * width, r * width + meta.query_lens[i])
    ctx = torch.tensor([meta.context_lens_list[i] for i in rows], device=dev)
    n = torch.tensor([meta.query_lens[i] for i in rows], device=dev)
    blocks = -(-int(ctx.max()) // block_size)
    # each query's position; a padding query takes the row's last, so its (discarded) softmax is over real keys
    q_pos = torch.minimum(ctx[:, None] - n[:, None] + torch.arange(width, device=dev), ctx[:, None] - 1)
    k_pos = torch.arange(blocks * block_size, device=dev)
    keep = k_pos[None, None, :] <= q_pos[:, :, None]
    if meta.sliding_window is not None:
        keep &= q_pos[:, :, None] - k_pos[None, None, :] < meta.sliding_window
    bias = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill_(~keep, float("-inf"))
    table = meta.block_tables[torch.tensor(rows, device=dev), :blocks]
    return PrefillBucket(torch.tensor(src, device=dev), torch.tensor(dst, device=dev), width, table,
                         bias[:, None])


def _kernel_rows(meta: AttentionMetadata, rows: list[int]) -> KernelRows:
    """Sequences `rows` (ascending) as one kernel row per query token, over that token's causal prefix."""
    starts = meta.cu_seqlens_q.tolist()
    counts = [meta.query_lens[i] for i in rows]
    ctx = [c for i in rows for c in range(meta.context_lens_list[i] - meta.query_lens[i] + 1,
                                          meta.context_lens_list[i] + 1)]
    dev = meta.context_lens.device
    if rows == list(range(len(rows))):  # the step's leading sequences: their tokens are a leading slice
        tokens = slice(0, starts[len(rows)])
        tables = meta.block_tables[:len(rows)]
    else:
        tokens = torch.tensor([t for i in rows for t in range(starts[i], starts[i + 1])], device=dev)
        tables = meta.block_tables[torch.tensor(rows, device=dev)]
    if len(rows) != sum(counts):  # a prefill row among them: its table once per query token
        tables = tables.repeat_interleave(torch.tensor(counts, device=dev), dim=0)
    return KernelRows(tokens, tables.contiguous(), torch.tensor(ctx, dtype=torch.int32, device=dev))


def _prefill_rows(meta: AttentionMetadata, block_size: int, skip: set[int]) -> list[PrefillRow]:
    rows = []
    for i in range(meta.num_decodes, len(meta.query_lens)):
        if i in skip:
            continue
        start, end = int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1])
        n, ctx = end - start, meta.context_lens_list[i]
        table = meta.block_tables[i:i + 1, : -(-ctx // block_size)]
        window = meta.sliding_window is not None and ctx > meta.sliding_window
        mask = None
        if n != ctx or window:  # SDPA's is_causal aligns the query to the context's start: only right when equal
            q_pos = torch.arange(ctx - n, ctx, device=table.device)[:, None]
            k_pos = torch.arange(ctx, device=table.device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= q_pos - k_pos < meta.sliding_window
        rows.append(PrefillRow(slice(start, end), ctx, table, mask))
    return rows


def _gather(cache: LayerCache, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of `table` [rows, n] as contiguous K and V [rows, kv_heads, n * block_size, head_dim]."""
    rows, n = table.shape
    ids = table.reshape(-1)
    k, v = cache.k.index_select(0, ids), cache.v.index_select(0, ids)  # [rows * n, bs, h, d]
    if cache.k_scale is not None:
        k = dequantize_kv_int8(k, cache.k_scale.index_select(0, ids), dtype)
        v = dequantize_kv_int8(v, cache.v_scale.index_select(0, ids), dtype)
    shape = (rows, n * cache.k.shape[1], cache.k.shape[2], cache.k.shape[3])
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
