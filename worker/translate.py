"""Between OpenAI request bodies and the engine: prompt tokens and SamplingParams in, Generations out.

The one place a request crosses from api/'s formats (api/batch_lines.py) into engine arguments; api/results.py
builds the response bodies from the Generations.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sluice.api.batch_lines import CHAT_URL, PROMPT_FIELDS, Body, ChatBody
from sluice.api.results import Generation, TokenLogprob, response_body
from sluice.worker.engine import InputProcessor, RequestOutput, RequestRejected, SamplingParams
from sluice.worker.engine.detokenizer import TokenText, decode, decoder_types
from sluice.worker.structured import grammar_param, structured_outputs
from sluice.worker.tool_calls import with_tool_calls

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class PromptError(ValueError):
    """A valid body the engine cannot run; `code` and `param` in OpenAI's terms."""

    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code, self.param = code, param


def engine_inputs(processor: InputProcessor, url: str, body: Body) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids (chat template applied) and sampling parameters; PromptError if it cannot run."""
    if url == CHAT_URL:
        try:
            token_ids = processor.encode_chat(chat_messages(body), body.tools)
        except Exception as e:  # the template is the model's code: any error in it fails this line only (as vLLM)
            raise PromptError("invalid_prompt", f"the chat template failed: {e}", "body.messages") from None
    else:
        token_ids = processor.encode(body.prompt)
    try:
        params = SamplingParams(**sampling_args(body, processor.max_request_tokens - len(token_ids)))
    except ValueError as e:  # the body models' limits match SamplingParams'; never lose the batch if they drift
        raise PromptError("invalid_value", str(e), "body") from None
    try:
        params.structured_outputs = structured_outputs(body)
    except ValueError as e:
        raise PromptError("invalid_value", str(e), grammar_param(body)) from None
    try:
        processor.check(token_ids, params)
    except RequestRejected as e:
        raise PromptError(e.code, str(e), f"body.{e.param}" if e.param else PROMPT_FIELDS[url]) from None
    return token_ids, params


def sampling_args(body: Body, room: int) -> dict[str, Any]:
    """SamplingParams field values for a valid body; `room` is the context left after the prompt, chat's default
    max_tokens (at least 1, so that a prompt filling the context is refused by the engine with its own message)."""
    if isinstance(body, ChatBody):
        max_tokens = body.max_completion_tokens or body.max_tokens or max(room, 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        logprobs = body.logprobs
    optional = dict(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                    seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                    logit_bias=body.logit_bias and {int(t): b for t, b in body.logit_bias.items()})
    return {"max_tokens": max_tokens, "logprobs": logprobs, **{k: v for k, v in optional.items() if v is not None}}


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """Messages for the tokenizer's chat template; "developer" is OpenAI's newer name for "system"."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.content,
             **({"name": m.name} if m.name else {})} for m in body.messages]


PieceBytes = Callable[[str], bytes | None]
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(tokenizer: PreTrainedTokenizerBase) -> PieceBytes | None:
    """vocabulary piece -> the raw bytes it decodes to, as the tokenizer's decoder reads pieces; None for a decoder
    of neither kind below (a token's bytes are then its text's). Partial UTF-8 characters decode to U+FFFD, so
    OpenAI's logprob `bytes` must come from the piece, not from the token's text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow (Python) tokenizer has none
    kinds = set(decoder_types(backend.decoder if backend is not None else None))
    if "ByteLevel" in kinds:  # GPT-2, Llama 3, Qwen2: each byte is spelled as one printable character
        table = {char: byte for byte, char in bytes_to_unicode().items()}
        return lambda piece: bytes(table[c] for c in piece) if all(c in table for c in piece) else None
    if kinds & {"ByteFallback", "Metaspace"}:  # SentencePiece (Llama 2, Mistral): "▁" spells a space
        return _sentencepiece_bytes
    return None


def _sentencepiece_bytes(piece: str) -> bytes:
    byte = _BYTE_PIECE.fullmatch(piece)  # a byte-fallback token <0xNN> is that one byte
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")


class Responses:
    """Builds response generations from engine outputs, caching each token's text and bytes for logprobs; decodes
    the text of an output the engine did not detokenize (SamplingParams.detokenize=False) as the engine would have."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.texts = TokenText.of(tokenizer)
        self.token_text: dict[int, str] = {}
        self.piece_bytes = piece_bytes(tokenizer)
        # added tokens (special ones included) are kept as their text in the vocabulary, never byte-encoded
        self.added_ids = self.texts.special_ids | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.token_bytes: dict[int, bytes | None] = {}
        # a token's text is read after this one: alone, decode() drops a SentencePiece token's leading space
        self.anchor = tokenizer.encode("a", add_special_tokens=False)
        self.anchor_text = tokenizer.decode(self.anchor)

    def response(self, url: str, body: Body, out: RequestOutput, model: str, system_fingerprint: str) -> dict:
        """The response body of a finished request (a forced tool call's JSON read back as message.tool_calls)."""
        return response_body(url, with_tool_calls(self.generation(out), body), model, system_fingerprint)

    def generation(self, out: RequestOutput) -> Generation:
        """The request's generation; for n > 1 its choices' in `choices`, with usage counting the prompt once."""
        if not out.choices:
            return self._choice(out)
        choices = [self._choice(c) for c in out.choices]
        first = choices[0]
        return Generation(text=first.text, finish_reason=first.finish_reason, prompt_tokens=first.prompt_tokens,
                          completion_tokens=out.num_completion_tokens, cached_tokens=out.num_cached_tokens,
                          created=int(out.metrics.finish_time or time.time()), logprobs=first.logprobs,
                          choices=choices)

    def _choice(self, out: RequestOutput) -> Generation:
        logprobs = None
        if out.logprobs is not None:
            logprobs = [TokenLogprob(self._token(lp.token_id), lp.logprob, [(self._token(t), v) for t, v in lp.top],
                                     self._bytes(lp.token_id), [self._bytes(t) for t, _ in lp.top])
                        for lp in out.logprobs]
        text = out.text
        if text is None:
            # without detokenizing the engine matched no stop strings: a "stop" is an eos or stop token
            text = decode(self.tokenizer, self.texts, out.prompt_token_ids, out.token_ids, out.finish_reason == "stop")
        return Generation(text=text, finish_reason=out.finish_reason, prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
                          created=int(out.metrics.finish_time or time.time()), logprobs=logprobs)

    def _token(self, token_id: int) -> str:
        """The token's text as a piece of the text around it (OpenAI's logprob tokens join into the text)."""
        if token_id not in self.token_text:
            text = self.tokenizer.decode([token_id])
            if token_id not in self.texts.special_ids:
                after = self.tokenizer.decode(self.anchor + [token_id])
                text = after[len(self.anchor_text):] if after.startswith(self.anchor_text) else text
            self.token_text[token_id] = text
        return self.token_text[token_id]

    def _bytes(self, token_id: int) -> bytes | None:
        """The token's raw bytes; None where the vocabulary does not tell them (its text's bytes stand in)."""
        if token_id not in self.token_bytes:
            piece = None
            if self.piece_bytes is not None and token_id not in self.added_ids:
                piece = self.texts.to_token(token_id)
            self.token_bytes[token_id] = self.piece_bytes(piece) if piece is not None else None
        return self.token_bytes[token_id]
