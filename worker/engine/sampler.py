"""Turns logits into tokens: greedy, or temperature with top-k/top-p/min-p, per-request seeded generators."""

from __future__ import annotations

from collections.abc import Set

import torch

from sluice.worker.engine.penalties import process_logits
from sluice.worker.engine.sequence import Sequence, TokenLogprobs


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Set[int] = frozenset()
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [len(seqs), vocab] float32. Returns one token per sequence, plus logprobs where asked: those of the
    model's logits, before penalties and logit_bias (vLLM's default)."""
    raw, logits = logits, process_logits(logits, seqs, eos_token_ids)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        tokens[idx] = _sample_rows(logits[idx], [seqs[i] for i in rows])
    token_list = tokens.tolist()
    return token_list, _logprobs(raw, seqs, token_list)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
    logits = logits / temps[:, None]
    logits = _filter(logits, seqs)
    probs = logits.softmax(dim=-1)
    # exponential race (argmax of p / E, E ~ Exp(1)) equals sampling from p; seeded rows draw E from their own
    # generator, so their tokens do not depend on what else is in the batch
    noise = torch.empty_like(probs).exponential_()
    for i, s in enumerate(seqs):
        if s.generator is not None:
            noise[i].exponential_(generator=s.generator)
    return (probs / noise).argmax(dim=-1)


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    if all(k >= vocab for k in top_k) and all(p >= 1 for p in top_p) and not any(min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(top_k, device=logits.device)[:, None],
                                              float("-inf"))
    # top_p reads the distribution top_k leaves, renormalised (HF's TopK then TopP warpers, vLLM); min_p is a ratio
    # to the top token, which no filter drops, so the renormalising leaves it as it was
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest set whose mass reaches top_p (always the first token)
    drop = (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p, device=logits.device)[:, None]
    drop |= probs < probs[:, :1] * torch.tensor(min_p, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None]:
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if not wanted:
        return out
    logp = logits[wanted].log_softmax(dim=-1)
    k = max(seqs[i].params.logprobs for i in wanted)
    top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
    for row, i in enumerate(wanted):
        n = seqs[i].params.logprobs
        top = list(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist()))
        out[i] = TokenLogprobs(tokens[i], logp[row, tokens[i]].item(), top)
    return out
