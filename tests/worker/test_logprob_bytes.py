"""A chat logprob's `bytes` are its token's raw UTF-8 bytes, so that tokens splitting a multi-byte character join
back into the text (OpenAI's purpose for them); they were the bytes of U+FFFD, the text such a token has alone."""

from __future__ import annotations

import re

import pytest
import torch
from test_detokenizer import byte_fallback_tokenizer
from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sluice.api.results import chat_completion
from sluice.worker.engine import LLM, RequestOutput, SamplingParams
from sluice.worker.engine.demo import build_checkpoint
from sluice.worker.engine.sampler import sample
from sluice.worker.translate import Responses

# CJK characters (3 bytes) and an emoji (4): one token per byte in both test vocabularies
PROMPT, TEXT = "Say", " hi 中文, 😀 ok 字!"
BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}  # GPT-2's byte-level alphabet, inverted


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def llm(request, checkpoints, tmp_path_factory) -> LLM:
    """A tiny Llama with the demo tokenizer (GPT-2-style byte-level BPE, as Llama 3 and Qwen2), or with a
    Llama-2-style SentencePiece vocabulary whose non-ASCII characters are byte-fallback tokens <0xNN>."""
    if request.param == "byte_level":
        return LLM(str(checkpoints("llama")), num_kv_blocks=64)
    tmp = tmp_path_factory.mktemp("sentencepiece")
    byte_fallback_tokenizer(tmp / "tokenizer")
    path = build_checkpoint(tmp / "model", "LlamaForCausalLM", seed=1, tokenizer_dir=tmp / "tokenizer",
                            num_key_value_heads=2)
    return LLM(str(path), num_kv_blocks=64)


def generate(llm: LLM, monkeypatch, detokenize: bool = True) -> tuple[RequestOutput, dict]:
    """The engine's output of TEXT's tokens after PROMPT, with top-5 logprobs, and its chat completion body. The
    model's logits are raised so that TEXT's tokens are sampled in turn and the rest of them lead top_logprobs:
    the top entries are pieces of characters too."""
    prompt = llm.tokenizer.encode(PROMPT)
    ids = llm.tokenizer.encode(PROMPT + TEXT)[len(prompt):]
    queue = iter(ids)

    def scripted(logits: torch.Tensor, seqs: list, *rest) -> tuple:
        logits = logits.clone()
        for row in range(len(seqs)):
            logits[row, ids] += 5.0
            logits[row, next(queue)] = logits[row].max() + 10.0
        return sample(logits, seqs, *rest)

    monkeypatch.setattr("sluice.worker.engine.llm.sample", scripted)
    params = SamplingParams(max_tokens=len(ids), temperature=0, logprobs=5, detokenize=detokenize)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ids
    return out, chat_completion(Responses(llm.tokenizer).generation(out), "m")


def vocab_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes the tokenizer's vocabulary spells for a token: added (special) tokens are their text."""
    if token_id in tokenizer.added_tokens_decoder:
        return tokenizer.decode([token_id]).encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
        return bytes(BYTE_OF[c] for c in piece)
    byte = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


@pytest.mark.parametrize("detokenize", [True, False])  # the engine's text, or the worker's replay of it
def test_bytes_join_into_the_text(llm, monkeypatch, detokenize):
    _, body = generate(llm, monkeypatch, detokenize)
    choice = body["choices"][0]
    assert choice["message"]["content"] == TEXT
    content = choice["logprobs"]["content"]
    assert sum(entry["token"] == "\ufffd" for entry in content) == 13  # every byte of 中, 文, 😀 and 字
    assert b"".join(bytes(entry["bytes"]) for entry in content) == TEXT.encode()


def test_each_tokens_bytes_are_the_tokenizers(llm, monkeypatch):
    """Sampled and top_logprobs tokens alike: the bytes their vocabulary pieces spell and, wherever the text's
    bytes before a token and its own end on a whole character, the tokenizer's decode of those tokens."""
    out, body = generate(llm, monkeypatch)
    tokenizer, prompt = llm.tokenizer, out.prompt_token_ids
    before = tokenizer.decode(prompt)
    content = body["choices"][0]["logprobs"]["content"]
    text, decoded, partial = b"", 0, 0
    for i, (entry, lp) in enumerate(zip(content, out.logprobs, strict=True)):
        for e, token_id in [(entry, lp.token_id), *zip(entry["top_logprobs"], [t for t, _ in lp.top], strict=True)]:
            assert bytes(e["bytes"]) == vocab_bytes(tokenizer, token_id), (i, e)
            if (expected := _utf8(text + bytes(e["bytes"]))) is None:
                partial += 1
                continue
            whole = tokenizer.decode(prompt + out.token_ids[:i] + [token_id])
            assert whole.startswith(before) and whole[len(before):] == expected, (i, e)
            decoded += 1
        text += bytes(entry["bytes"])
    assert decoded > len(content) and partial > len(content)  # both kinds of check ran, on many tokens
