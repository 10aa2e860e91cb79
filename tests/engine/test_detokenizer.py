"""Incremental detokenization through the Rust backend directly gives the text transformers' wrappers give, and
transformers' decode(skip_special_tokens=True) text."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sluice.api.results import text_completion
from sluice.worker.engine import RequestOutput, detokenizer
from sluice.worker.engine.detokenizer import TokenText
from sluice.worker.engine.outputs import RequestMetrics
from sluice.worker.engine.sequence import TokenLogprobs
from sluice.worker.translate import Responses


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


def test_a_byte_level_text_at_once_is_the_replays(tokenizer_dir, monkeypatch):
    """decode() takes a byte-level tokenizer's text in a few decodes where its context has no U+FFFD: the same text
    as the token-by-token replay (the engine's algorithm), whole characters split across tokens, special tokens, ids
    past the vocabulary, a stop token's text left out, and a character the output ends inside (or stray bytes at its
    end), which the replay holds back, included; where the context has one, the replay itself."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fast = TokenText.of(tokenizer)
    assert fast.byte_level
    replay = TokenText(fast.to_token, fast.to_string, fast.special_ids)  # byte_level False: the replay alone
    rng, vocab, specials = random.Random(2), len(tokenizer), sorted(fast.special_ids)
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (" 中文", "字", " 😀", " ok", "é!", " the")]
    taken, at_once, held_back = [], detokenizer._at_once, 0
    monkeypatch.setattr(detokenizer, "_at_once", lambda *a: taken.append(result := at_once(*a)) or result)
    for n in range(2000):
        prompt = [i for _ in range(rng.randrange(1, 4)) for i in rng.choice(words)]
        prompt += [rng.randrange(vocab)] if rng.random() < 0.2 else []  # at times ending inside a character
        output, words_share = [], 0.7 if n % 2 else 0.0  # every other output: any ids, stray bytes throughout
        while len(output) < 20:  # whole characters, split ones, specials and ids past the vocabulary
            pick = rng.random()
            output += (rng.choice(words) if pick < words_share else [rng.choice(specials)]
                       if pick < words_share + 0.1 else [vocab + 7] if pick < words_share + 0.13
                       else [rng.randrange(vocab)])
        stopped = rng.random() < 0.5
        expected = detokenizer.decode(tokenizer, replay, prompt, output, stopped)
        held_back += tokenizer.decode(output[:-1] if stopped else output).endswith("\ufffd")
        assert detokenizer.decode(tokenizer, fast, prompt, output, stopped) == expected
    at_once = [r for r in taken if r is not None]
    assert len(taken) == 2000 and len(at_once) > 1500 and len(taken) - len(at_once) > 50  # both paths
    assert sum("\ufffd" in r for r in at_once) > 100  # stray bytes inside the text, taken at once
    assert held_back > 300  # outputs ending inside a character or in stray bytes, taken at once


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


def byte_fallback_tokenizer(path) -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE: "▁" for spaces, ASCII letters in the vocabulary and every other character
    as byte-fallback tokens <0xNN> (so each CJK character is three tokens), decoded by ByteFallback and Fuse."""
    letters = ["▁"] + [chr(c) for c in range(33, 127)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *letters])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        path)
    return AutoTokenizer.from_pretrained(path)


def test_byte_fallback_text_after_a_prompt_of_multi_byte_characters(tmp_path):
    """The prompt's last few tokens, decoded as context, may start inside a character; with byte-fallback tokens
    that poisons the whole run of bytes, the output's included (ByteFallback decodes an invalid run as one U+FFFD
    per byte), and the output's CJK text was lost. The text must be decode(prompt + output) less decode(prompt)."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    fast = TokenText.of(tokenizer)
    wrapped = TokenText(tokenizer.convert_ids_to_tokens, tokenizer.convert_tokens_to_string, fast.special_ids)
    for prompt_text, output_text in [("中文字", "符号"), ("ab 中文", "字 ok"), ("日本語", "のテキスト"), ("x", " 😀y")]:
        prompt = tokenizer.encode(prompt_text)
        output = tokenizer.encode(prompt_text + output_text)[len(prompt):]
        assert len(prompt) > detokenizer.CONTEXT_TOKENS + 1 or prompt_text == "x"
        whole, before = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        assert whole.startswith(before)
        expected = whole[len(before):]
        assert _text(fast, tokenizer, prompt, output) == _text(wrapped, tokenizer, prompt, output) == expected


def _output(prompt: list[int], output: list[int], top: int) -> RequestOutput:
    logprobs = [TokenLogprobs(t, -1.0, [(t, -1.0), *((u, -2.0) for u in output[:top] if u != t)]) for t in output]
    return RequestOutput("r", None, prompt, output, None, True, "length", 0,
                         RequestMetrics(0.0, 0.0, 0.0, 1.0, 0.0, 0), logprobs)


def test_logprob_tokens_keep_their_leading_spaces(tmp_path, tokenizer_dir):
    """OpenAI's logprob tokens are pieces of the text: a completion's tokens join into its text and text_offset
    indexes it. decode([id]) alone drops a SentencePiece token's leading space ("▁world" -> "world"), so "world"
    and "▁world" also collapsed into one top_logprobs key."""
    for tokenizer in (byte_fallback_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tokenizer_dir)):
        prompt, text = tokenizer.encode("Say"), " hello world, all ok"
        output = tokenizer.encode("Say" + text)[len(prompt):]
        gen = Responses(tokenizer).generation(_output(prompt, output, top=len(output)))
        assert gen.text == text
        logprobs = text_completion(gen, "m")["choices"][0]["logprobs"]
        assert "".join(logprobs["tokens"]) == text
        assert [text[i:].startswith(t) for i, t in zip(logprobs["text_offset"], logprobs["tokens"])] == [True] * len(
            output)
        assert all(len(top) == len(set(output)) for top in logprobs["top_logprobs"])  # distinct ids, distinct keys
