"""Incremental detokenization through the Rust backend directly gives the text transformers' wrappers give, and
transformers' decode(skip_special_tokens=True) text."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from worker.engine import detokenizer
from worker.engine.detokenizer import TokenText


def _text(token_text: TokenText, tokenizer, prompt: list[int], output: list[int]) -> str:
    return detokenizer.decode(tokenizer, token_text, prompt, output)


def test_the_backend_path_gives_the_wrappers_text(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fast = TokenText.of(tokenizer)
    assert fast.to_token == tokenizer._tokenizer.id_to_token  # the wrappers are skipped
    wrapped = TokenText(tokenizer.convert_ids_to_tokens, tokenizer.convert_tokens_to_string, fast.special_ids)
    rng = random.Random(0)
    vocab = len(tokenizer)
    specials = sorted(fast.special_ids)
    for _ in range(200):  # random ids split multi-byte characters and mix in special tokens
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(30)]
        assert _text(fast, tokenizer, prompt, output) == _text(wrapped, tokenizer, prompt, output)


def test_a_tokenizer_class_with_its_own_wrappers_keeps_them(tokenizer_dir):
    base = AutoTokenizer.from_pretrained(tokenizer_dir)

    class Shouting(type(base)):
        def convert_tokens_to_string(self, tokens):
            return super().convert_tokens_to_string(tokens).upper()

    tokenizer = Shouting.from_pretrained(tokenizer_dir)
    text = TokenText.of(tokenizer)
    assert text.to_string.__func__ is Shouting.convert_tokens_to_string
    ids = tokenizer.encode("hello there")
    assert _text(text, tokenizer, ids[:1], ids[1:]) == _text(text, tokenizer, ids[:1], ids[1:]).upper() != ""


def test_text_is_transformers_decode_without_special_tokens(tokenizer_dir):
    """Added tokens flagged special (the chat markers <|system|>, <|user|>, <|assistant|>, which all_special_ids
    leaves out) are dropped from the text, as decode(skip_special_tokens=True) drops them, on both paths."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    markers = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i not in tokenizer.all_special_ids]
    assert markers  # the demo tokenizer has some
    fast = TokenText.of(tokenizer)
    wrapped = TokenText(tokenizer.convert_ids_to_tokens, tokenizer.convert_tokens_to_string, fast.special_ids)
    # ids whose own text is ASCII: whole characters, so the incremental text and one decode of it all agree
    plain = [i for i in range(len(tokenizer)) if i not in fast.special_ids and tokenizer.decode([i]).isascii()]
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.choice(plain + markers) for _ in range(rng.randrange(1, 12))]
        output = [rng.choice(markers) if rng.random() < 0.2 else rng.choice(plain) for _ in range(30)]
        expected = tokenizer.decode(output, skip_special_tokens=True)
        assert _text(fast, tokenizer, prompt, output) == _text(wrapped, tokenizer, prompt, output) == expected
