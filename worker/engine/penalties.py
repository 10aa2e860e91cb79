"""Logit processing before sampling: logit_bias, min_tokens, repetition, frequency and presence penalties.

One batched pass over the rows that use any of them; a step whose rows use none pays one check per row. The order is
vLLM V1's (and transformers' generate's): min_tokens and logit_bias, then the repetition penalty, then frequency and
presence. Every tensor is rebuilt from the sequences' tokens each step, so preemption by recompute, chunked prefill
and prefix caching (which change only what is in the KV cache) change nothing here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Set

import torch

from sluice.worker.engine.sampling_params import SamplingParams
from sluice.worker.engine.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Set[int]) -> torch.Tensor:
    """logits [len(seqs), vocab] with every sequence's processing applied; `logits` itself is left unchanged
    (logprobs read the raw ones, as vLLM's default) and returned as is when no sequence asks for any."""
    rows = [i for i, s in enumerate(seqs) if _active(s)]
    if not rows:
        return logits
    active = [seqs[i] for i in rows]
    idx = torch.tensor(rows, device=logits.device)
    x = logits[idx]
    _mask_stops(x, active, eos_token_ids)
    _add_bias(x, active)
    x = _repetition(x, active)
    x = _frequency_presence(x, active)
    return logits.index_copy(0, idx, x)


def _active(seq: Sequence) -> bool:
    """Checked for every row of every step: plain attribute tests first, min_tokens' count only where it is set."""
    p = seq.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 or p.logit_bias
                or (p.min_tokens and _under_min_tokens(seq)))


def _under_min_tokens(seq: Sequence) -> bool:
    return seq.num_tokens - seq.num_prompt_tokens < seq.params.min_tokens


def _put(x: torch.Tensor, pairs: list[tuple[int, int]], values: list[float] | float, accumulate: bool) -> None:
    """One index_put over (row, token id) pairs: values one per pair, or one for all."""
    if pairs:
        rows, ids = torch.tensor(pairs, device=x.device).T
        x.index_put_((rows, ids), torch.as_tensor(values, dtype=x.dtype, device=x.device), accumulate=accumulate)


def _mask_stops(x: torch.Tensor, seqs: list[Sequence], eos_token_ids: Set[int]) -> None:
    """min_tokens: no stop token (EOS unless ignore_eos, and stop_token_ids) until that many were generated."""
    vocab = x.shape[-1]
    pairs = [(r, t) for r, s in enumerate(seqs) if _under_min_tokens(s)
             for t in _stop_ids(s.params, eos_token_ids) if t < vocab]  # an id past the vocabulary is never sampled
    _put(x, pairs, float("-inf"), accumulate=False)


def _stop_ids(p: SamplingParams, eos_token_ids: Set[int]) -> set[int]:
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))


def _add_bias(x: torch.Tensor, seqs: list[Sequence]) -> None:
    pairs = [(r, t) for r, s in enumerate(seqs) for t in s.params.logit_bias]
    values = [b for s in seqs for b in s.params.logit_bias.values()]
    _put(x, pairs, values, accumulate=True)


def _token_mask(x: torch.Tensor, token_lists: list[list[int]], counts: bool) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in each row's list (counts), or whether it does."""
    rows, vocab = x.shape
    lengths = torch.tensor([len(t) for t in token_lists], device=x.device)
    flat_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=x.device)
    # output_size spares CUDA a sync to learn it
    flat = torch.arange(rows, device=x.device).repeat_interleave(lengths, output_size=len(flat_ids)) * vocab + flat_ids
    out = torch.zeros(rows * vocab, dtype=x.dtype if counts else torch.bool, device=x.device)
    if counts:
        out.scatter_add_(0, flat, torch.ones_like(flat, dtype=x.dtype))
    else:
        out[flat] = True
    return out.view(rows, vocab)


def _column(seqs: Iterable[Sequence], name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([getattr(s.params, name) for s in seqs], dtype=x.dtype, device=x.device)[:, None]


def _repetition(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt and output: a seen token's logit is divided by
    the penalty if positive, multiplied if negative."""
    if all(s.params.repetition_penalty == 1 for s in seqs):
        return x
    seen = _token_mask(x, [s.token_ids for s in seqs], counts=False)
    penalty = _column(seqs, "repetition_penalty", x)
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def _frequency_presence(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI's formula over the output so far: logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty."""
    if not any(s.params.frequency_penalty or s.params.presence_penalty for s in seqs):
        return x
    counts = _token_mask(x, [s.output_token_ids for s in seqs], counts=True)
    return (x - counts * _column(seqs, "frequency_penalty", x)
            - (counts > 0).to(x.dtype) * _column(seqs, "presence_penalty", x))
