"""The result formats: OpenAI response bodies built from finished generations, and the output and error file lines.

A line of the output file carries a response body (chat.completion or text_completion, with usage, logprobs and
tool_calls as OpenAI shapes them); a line of the error file carries a LineError, with the batch-error fields `param`
and `line`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from itertools import accumulate

from sluice.api.batch_lines import CHAT_URL, COMPLETIONS_URL, LineError


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]
    # the raw UTF-8 bytes of the token and of each top entry, which a token's text lacks when it is part of a
    # multi-byte character (its text is then U+FFFD); None where unknown: the text's bytes stand in
    token_bytes: bytes | None = None
    top_bytes: list[bytes | None] | None = None


@dataclass
class Generation:
    """A finished request in engine-neutral terms: what the response builders need."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created: int
    logprobs: list[TokenLogprob] | None = None
    # OpenAI's message.tool_calls ({"id", "type": "function", "function": {"name", "arguments"}}): set for a forced
    # call (worker/tool_calls.py), whose text is then not the message's content
    tool_calls: list[dict] | None = None
    # n > 1: each choice's generation, in index order (their usage fields unused: the request's above count the
    # prompt once and the completion tokens over every choice)
    choices: list[Generation] | None = None


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _token_entry(token: str, logprob: float, raw: bytes | None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8") if raw is None else raw)}


def _content_entry(lp: TokenLogprob) -> dict:
    top_bytes = lp.top_bytes if lp.top_bytes is not None else [None] * len(lp.top)
    return {**_token_entry(lp.token, lp.logprob, lp.token_bytes),
            "top_logprobs": [_token_entry(t, v, raw) for (t, v), raw in zip(lp.top, top_bytes, strict=True)]}


def chat_completion(gen: Generation, model: str, system_fingerprint: str | None = None) -> dict:
    return {
        "id": _new_id("chatcmpl-"), "object": "chat.completion", "created": gen.created, "model": model,
        "choices": [_chat_choice(i, g) for i, g in enumerate(gen.choices or [gen])],
        "usage": _usage(gen), "system_fingerprint": system_fingerprint,
    }


def _chat_choice(index: int, gen: Generation) -> dict:
    logprobs = None
    if gen.logprobs is not None:
        logprobs = {"content": [_content_entry(lp) for lp in gen.logprobs], "refusal": None}
    message = {"role": "assistant", "content": gen.text, "refusal": None}
    if gen.tool_calls is not None:
        message.update(content=None, tool_calls=gen.tool_calls)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": gen.finish_reason}


def _top_with_sampled(lp: TokenLogprob) -> dict[str, float]:
    """OpenAI's completions always list the sampled token too: up to logprobs + 1 entries."""
    return {**dict(lp.top), lp.token: lp.logprob}


def text_completion(gen: Generation, model: str, system_fingerprint: str | None = None) -> dict:
    return {
        "id": _new_id("cmpl-"), "object": "text_completion", "created": gen.created, "model": model,
        "choices": [_text_choice(i, g) for i, g in enumerate(gen.choices or [gen])],
        "usage": _usage(gen), "system_fingerprint": system_fingerprint,
    }


def _text_choice(index: int, gen: Generation) -> dict:
    logprobs = None
    if gen.logprobs is not None:
        tokens = [lp.token for lp in gen.logprobs]
        offsets = list(accumulate(map(len, tokens), initial=0))[:-1]  # into the completion's text
        logprobs = {"tokens": tokens, "token_logprobs": [lp.logprob for lp in gen.logprobs],
                    "top_logprobs": [_top_with_sampled(lp) for lp in gen.logprobs], "text_offset": offsets}
    return {"text": gen.text, "index": index, "logprobs": logprobs, "finish_reason": gen.finish_reason}


RESPONSE_BUILDERS = {CHAT_URL: chat_completion, COMPLETIONS_URL: text_completion}


def response_body(url: str, gen: Generation, model: str, system_fingerprint: str | None = None) -> dict:
    """The body OpenAI answers `url` with; system_fingerprint names the configuration that ran it
    (worker/fingerprint.py)."""
    return RESPONSE_BUILDERS[url](gen, model, system_fingerprint)


def output_line(custom_id: str, body: dict, line_id: str | None = None, request_id: str | None = None) -> dict:
    """A line of the output file: a request that succeeded."""
    return {"id": line_id or _new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id or _new_id("req_"), "body": body},
            "error": None}


def error_line(error: LineError, line_id: str | None = None) -> dict:
    """A line of the error file: OpenAI's per-request error, plus the batch-error fields `param` and `line`."""
    return {"id": line_id or _new_id("batch_req_"), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message, "param": error.param, "line": error.line}}
