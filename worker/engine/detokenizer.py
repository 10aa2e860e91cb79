"""Incremental detokenization: the text a new token adds, decoded in the context of the tokens before it."""

from __future__ import annotations

from worker.engine.sequence import Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded as context, so a first output token keeps its leading space


def start(tokenizer, seq: Sequence) -> None:
    context = tokenizer.convert_ids_to_tokens(seq.prompt_token_ids[-(CONTEXT_TOKENS + 1):], skip_special_tokens=True)
    seq.detok_tokens = [t for t in context if t is not None]
    seq.prefix_offset = max(len(seq.detok_tokens) - CONTEXT_TOKENS, 0)
    seq.read_offset = len(seq.detok_tokens)


def append(tokenizer, seq: Sequence, token_id: int, special_ids: frozenset[int]) -> str:
    """Add one generated token; return the text it completes (empty while a multi-byte character is split).
    `special_ids` is the tokenizer's all_special_ids, taken once: the property rebuilds its list on every read."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token is None or token_id in special_ids:  # None: ids past the tokenizer (padded vocab)
        return ""
    seq.detok_tokens.append(token)
    prefix = tokenizer.convert_tokens_to_string(seq.detok_tokens[seq.prefix_offset:seq.read_offset])
    full = tokenizer.convert_tokens_to_string(seq.detok_tokens[seq.prefix_offset:])
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.detok_tokens)
    return full[len(prefix):]
