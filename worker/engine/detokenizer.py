"""Incremental detokenization: the text a new token adds, decoded in the context of the tokens before it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

CONTEXT_TOKENS = 5  # prompt tokens decoded as context, so a first output token keeps its leading space
MAX_CONTEXT_TOKENS = 24  # how far back the context may reach to start on a whole character (vLLM V1's bound)


@dataclass(frozen=True)
class TokenText:
    """The tokenizer's id -> token and tokens -> text, bound once per engine.

    Two calls per generated token: on a Rust-backed tokenizer transformers' wrappers around them (property reads,
    isinstance checks) cost more than the Rust decode itself, so the engine calls the backend directly when the
    tokenizer's class uses the base wrappers unchanged (the same functions, the same text).
    """

    to_token: Callable[[int], str | None]
    to_string: Callable[[list[str]], str]
    special_ids: frozenset[int]  # skipped ids (special_ids_of), taken once: all_special_ids rebuilds on every read
    # the decoder is byte-level alone (GPT-2, Llama 3, Qwen2): tokens -> their bytes -> lossy UTF-8, so the text of
    # tokens a + b is the text of a then of b wherever a's ends on a whole character
    byte_level: bool = False

    def tokens(self, tokenizer, ids: list[int]) -> list[str]:
        """The tokens of ids less special_ids; where the backend serves to_token, without convert_ids_to_tokens'
        rebuilding all_special_ids on every call."""
        if self.to_token == getattr(tokenizer, "convert_ids_to_tokens", None):  # the wrappers: keep them
            return tokenizer.convert_ids_to_tokens([i for i in ids if i not in self.special_ids],
                                                   skip_special_tokens=True)
        return [self.to_token(i) for i in ids if i not in self.special_ids]

    @classmethod
    def of(cls, tokenizer) -> TokenText:
        special = special_ids_of(tokenizer)
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not _base_wrappers(type(tokenizer)):
            return cls(tokenizer.convert_ids_to_tokens, tokenizer.convert_tokens_to_string, special)
        decoder = backend.decoder
        byte_level = decoder_types(decoder) == ("ByteLevel",)
        return cls(backend.id_to_token, decoder.decode if decoder is not None else " ".join, special, byte_level)


def decoder_types(decoder) -> tuple[str, ...]:
    """A tokenizers decoder's type, then those of the decoders in it (a Sequence's), depth first; () for None."""
    def types(config: dict) -> tuple[str, ...]:
        return (config["type"], *(t for d in config.get("decoders", []) for t in types(d)))

    return () if decoder is None else types(json.loads(decoder.__getstate__()))


def special_ids_of(tokenizer) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops: all_special_ids misses added tokens flagged special but not
    named in the special tokens map (chat markers such as <|user|>, Llama-3's <|start_header_id|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _base_wrappers(cls: type) -> bool:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its wrappers
        return False
    return issubclass(cls, TokenizersBackend) and all(
        getattr(cls, name) is getattr(TokenizersBackend, name)
        for name in ("convert_ids_to_tokens", "convert_tokens_to_string"))


class State(Protocol):
    """What the detokenizer reads and keeps per sequence (a Sequence has it)."""

    prompt_token_ids: list[int]
    detok_tokens: list[str]  # output tokens as strings, after a few prompt tokens of context
    prefix_offset: int
    read_offset: int


@dataclass
class Replay:
    prompt_token_ids: list[int]
    detok_tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0


def decode(tokenizer, text: TokenText, prompt_token_ids: list[int], token_ids: list[int],
           stopped_by_token: bool = False) -> str:
    """The text the engine builds token by token for these output tokens, built here from the finished output:
    the same calls in the same order, so the same text (for requests run with SamplingParams(detokenize=False)).
    `stopped_by_token`: the last token was an eos or stop token, whose text the engine leaves out."""
    state = Replay(prompt_token_ids)
    start(tokenizer, state, text)
    if text.byte_level and (whole := _at_once(tokenizer, text, state.detok_tokens, token_ids,
                                              stopped_by_token)) is not None:
        return whole
    pieces = [append(text, state, t) for t in token_ids]
    return "".join(pieces[:-1] if stopped_by_token else pieces)


def _at_once(tokenizer, text: TokenText, context: list[str], token_ids: list[int],
             stopped_by_token: bool) -> str | None:
    """The replay's text in a few decodes instead of two a token, for a byte-level decoder (lossy UTF-8 of the
    tokens' bytes): each piece the replay emits ends where its decode did not end in U+FFFD, so on a character
    boundary, from which lossy decoding goes on as if the bytes before were not there; the pieces therefore join
    into the text after the context, U+FFFD for stray bytes included. The replay never emits what follows its last
    such boundary (a character the output ends inside, stray bytes at its end): the text of the tokens up to the
    last one whose text does not end in U+FFFD. Not where the context holds a U+FFFD (it may end inside a character
    the output completes): None there."""
    kept = [t for t in text.tokens(tokenizer, token_ids[:-1] if stopped_by_token else token_ids) if t is not None]
    prefix = text.to_string(context)
    if "\ufffd" in prefix:
        return None
    end, whole = len(kept), text.to_string(context + kept)
    while whole.endswith("\ufffd") and end > 0:  # held back by the replay: usually a token or two
        end -= 1
        whole = text.to_string(context + kept[:end])
    if not whole.startswith(prefix):
        return None
    return whole[len(prefix):]


def start(tokenizer, seq: State, text: TokenText) -> None:
    seq.detok_tokens = _context(tokenizer, seq.prompt_token_ids, text)
    seq.prefix_offset, seq.read_offset = 0, len(seq.detok_tokens)


def _context(tokenizer, prompt: list[int], text: TokenText) -> list[str]:
    """The last prompt tokens, at least CONTEXT_TOKENS, back to where they decode to whole characters (as vLLM V1
    picks its prompt suffix): a context starting inside a character decodes to U+FFFD there, and ByteFallback
    (Llama 2, Mistral) decodes a run of byte tokens with one invalid byte as U+FFFD throughout, the output's bytes
    that continue the run included. A prompt ending inside a character keeps the shortest context."""
    def tokens(n: int) -> list[str]:
        return [t for t in text.tokens(tokenizer, prompt[-n:]) if t is not None]

    for n in range(CONTEXT_TOKENS, min(len(prompt), MAX_CONTEXT_TOKENS) + 1):
        context = tokens(n)
        if "\ufffd" not in text.to_string(context):
            return context
    return tokens(CONTEXT_TOKENS)


def append(text: TokenText, seq: State, token_id: int) -> str:
    """Add one generated token; return the text it completes (empty while a multi-byte character is split)."""
    token = text.to_token(token_id)
    if token is None or token_id in text.special_ids:  # None: ids past the tokenizer (padded vocab)
        return ""
    seq.detok_tokens.append(token)
    prefix = text.to_string(seq.detok_tokens[seq.prefix_offset:seq.read_offset])
    full = text.to_string(seq.detok_tokens[seq.prefix_offset:])
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.detok_tokens)
    return full[len(prefix):]
