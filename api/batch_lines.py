"""The request formats: OpenAI batch input lines and their bodies, validated line by line into requests or errors.

Bodies accept OpenAI's documented fields for /v1/chat/completions and /v1/completions plus six sluice extensions
named as vLLM names them (top_k, min_p, ignore_eos, stop_token_ids, repetition_penalty, min_tokens, and on
/v1/completions guided_json, guided_regex and guided_choice). An unknown
field, a wrong type or an out-of-range value is an error naming the field (a logit_bias token id outside the model's
vocabulary is found where the request is translated for the engine); a documented field sluice cannot honour (stream,
echo, suffix, best_of > 1, several prompts in one line, tool_choice "auto", audio,
...) is an `unsupported_value` error unless left at its default. `model` names the served model or LoRA adapter
(api.store.batches checks it against the batch's); `user`, `metadata`, `store` and `service_tier` are accepted and
ignored.

Error codes: invalid_json_line, missing_required_parameter, unknown_parameter, invalid_value, unsupported_value,
invalid_url, invalid_method, duplicate_custom_id, context_length_exceeded (prompt plus max_tokens longer than the
model or the cache allows), invalid_prompt (the chat template or the engine refused the prompt, e.g. empty).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sluice.api.response_format import MAX_SCHEMA_CHARS, check_json_schema, check_response_format
from sluice.api.text import readable, valid_unicode
from sluice.api.tools import UnsupportedChoice, check_tools, forced_tools

CHAT_URL = "/v1/chat/completions"
GUIDED = ("guided_json", "guided_regex", "guided_choice")  # /v1/completions' structured outputs, in field order
COMPLETIONS_URL = "/v1/completions"
PROMPT_FIELDS = {CHAT_URL: "body.messages", COMPLETIONS_URL: "body.prompt"}
LOGIT_BIAS_MAX = 300  # entries, as OpenAI
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate code point


def _unsupported(detail: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", "{detail}", {"detail": detail})


def _invalid(detail: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{detail}", {"detail": detail})


def _checked(check: Callable[[Any], None], value: Any) -> Any:
    """A field validator's value once `check` (which raises ValueError naming the problem) accepts it."""
    if value is not None:
        try:
            check(value)
        except ValueError as e:
            raise _invalid(str(e)) from None
    return value


def _refused(*fields: str, detail: str, defaults: tuple = ()):
    """A validator for documented fields sluice cannot honour: unsupported_value unless left out, empty, zero or
    false, or at one of `defaults`."""
    def check(cls, v):
        if v and v not in defaults:
            raise _unsupported(detail)
        return v
    return field_validator(*fields)(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class BatchRequestLine(_Strict):
    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class _SamplingBody(_Strict):
    """Fields both endpoints share; null means the default, as in OpenAI's API."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)  # choices from one prefill of the prompt
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=4)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # token id (a string of an integer, as JSON keys are) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=LOGIT_BIAS_MAX)
    user: str | None = None
    # documented fields that change nothing a batch line produces: accepted and ignored, as `user`
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # sluice extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    _no_stream = _refused("stream", detail="stream must be false in a batch")
    _no_stream_options = _refused("stream_options",
                                  detail="stream_options needs stream, which a batch line cannot have")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise _invalid(f"logit_bias keys must be token ids (strings of integers >= 0), got {key!r}")
        return v

    @model_validator(mode="after")
    def _min_tokens(self):
        max_tokens = getattr(self, "max_completion_tokens", None) or self.max_tokens
        if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
            raise _invalid(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0:
            raise _invalid("top_k must be -1 (disabled) or >= 1")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # multi-turn tool use: refused by name (below), before a tool-call message's null content is
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    content: str
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _no_tool_results(cls, v):
        if v in ("tool", "function"):
            raise _unsupported(f'"{v}" messages (tool results) are not supported: a batch line can force one tool '
                               "call, not continue a conversation after one")
        return v

    _no_tool_calls = _refused("tool_calls", "tool_call_id", "function_call",
                              detail="multi-turn tool use (assistant tool_calls, tool results) is not supported")

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v):
        if not isinstance(v, list):
            return v
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.keys() == {"type", "text"} and part["type"] == "text"
                    and isinstance(part["text"], str)):
                raise _unsupported(f'part {i}: only text parts ({{"type": "text", "text": "..."}}) are supported')
        return "\n".join(part["text"] for part in v)


class ChatBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # a forced tool_choice produces one call either way: true and false are both honoured
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # api/response_format.py
    tools: list[Any] | None = None  # api/tools.py
    tool_choice: str | dict[str, Any] | None = Field(None, validate_default=True)  # checked against tools
    # documented fields sluice cannot honour: refused by name unless left at their default
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        return _checked(check_response_format, v)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        return _checked(check_tools, v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info: ValidationInfo):
        if "tools" not in info.data:
            return v  # the tools were invalid: that is the line's error
        try:
            forced = forced_tools(v, info.data["tools"])
        except UnsupportedChoice as e:
            raise _unsupported(str(e)) from None
        except ValueError as e:
            raise _invalid(str(e)) from None
        if forced and (info.data.get("response_format") or {}).get("type", "text") != "text":
            raise _unsupported("a forced tool call cannot also follow response_format: the output is the call's "
                               "JSON; leave response_format out")
        return v

    _no_functions = _refused("functions", "function_call", defaults=("none",),
                             detail='the deprecated functions and function_call are not supported; use tools and '
                                    'tool_choice')
    _text_only = _refused("modalities", defaults=(["text"],),
                          detail='only text output: leave it out or set it to ["text"]')
    _not_supported = _refused("audio", "prediction", "reasoning_effort", "web_search_options",
                              detail="not supported; leave it out")

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise _invalid("set max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs needs logprobs: true")
        return self


class CompletionBody(_SamplingBody):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's structured-output fields (at most one): a JSON schema (an object or its JSON text), a regex, or one of
    # the listed strings; whether the grammar compiles is known only in the worker, which fails that line alone
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_SCHEMA_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=1024)

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise _invalid(f"guided_json is not JSON: {e}") from None
        return _checked(lambda schema: check_json_schema(schema, "guided_json"), v)

    @field_validator("guided_regex", "guided_choice")
    @classmethod
    def _one_guide(cls, v, info: ValidationInfo):
        if v is not None and any(info.data.get(f) is not None for f in GUIDED[:GUIDED.index(info.field_name)]):
            raise _invalid("set at most one of guided_json, guided_regex and guided_choice")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            if len(v) > 1:
                raise _unsupported(f"{len(v)} prompts in one line; a batch line takes one prompt, put each on its own "
                                   "line")
            v = v[0]
        if isinstance(v, str) or (isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v)):
            return v
        raise _invalid("prompt must be a string or a non-empty list of token ids (integers >= 0)")

    _no_echo_or_suffix = _refused("echo", "suffix", detail="not supported; leave it out")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise _unsupported(f"best_of={v}: only 1 is supported")
        return v


Body = ChatBody | CompletionBody
BODIES: dict[str, type[Body]] = {CHAT_URL: ChatBody, COMPLETIONS_URL: CompletionBody}


@dataclass
class BatchRequest:
    """A valid input line."""

    line: int
    custom_id: str
    url: str
    body: Body


@dataclass
class LineError:
    """An input line that will not run; `message` starts with its line number."""

    line: int
    code: str
    message: str
    custom_id: str | None = None
    param: str | None = None


def line_error(line: int, code: str, detail: str, custom_id: str | None = None, param: str | None = None) -> LineError:
    where = f"line {line}: {param}: " if param else f"line {line}: "
    return LineError(line, code, where + detail, custom_id, param)


def line_text(raw: str | bytes) -> str:
    """A line's text: its bytes must be UTF-8 (the first line may start with a BOM), else UnicodeDecodeError;
    json.loads of the bytes would also take UTF-16 and encoded surrogates."""
    return raw.decode().removeprefix("\ufeff") if isinstance(raw, bytes) else raw  # utf-8-sig is 10x slower


def parse_line(raw: str | bytes, line: int) -> BatchRequest | LineError:
    """Validate one input line (1-based `line`) on its own; duplicates are BatchValidator's business."""
    try:
        text = line_text(raw)
        data = json.loads(text)
        lone_surrogate = _lone_surrogate(raw, text, data)
    except UnicodeDecodeError as e:
        return line_error(line, "invalid_json_line", f"not UTF-8 text ({e})")
    except ValueError as e:
        return line_error(line, "invalid_json_line", f"not valid JSON ({e})")
    except RecursionError:
        return line_error(line, "invalid_json_line", "not valid JSON: nested too deeply")
    if not isinstance(data, dict):
        return line_error(line, "invalid_json_line", f"a line must be a JSON object, not {type(data).__name__}")
    custom_id = _custom_id(data)
    if lone_surrogate:  # refused before the fields are, whose errors would quote it
        return line_error(line, "invalid_value", "contains a lone UTF-16 surrogate escape (\\ud800 to \\udfff "
                          "outside a pair), which is not valid Unicode", custom_id and readable(custom_id))
    try:
        head = BatchRequestLine.model_validate(data)
    except ValidationError as e:
        return _validation_error(e, line, custom_id, ())
    try:
        body = BODIES[head.url].model_validate(head.body)
    except ValidationError as e:
        return _validation_error(e, line, custom_id, ("body",))
    return BatchRequest(line, head.custom_id, head.url, body)


def _lone_surrogate(raw: str | bytes, text: str, data: Any) -> bool:
    """Whether a string or key of the line holds a lone surrogate. Decoded strictly from UTF-8, a line holds one only
    from an unpaired \\uD800-\\uDFFF escape: the cheap search spares ordinary lines the full check."""
    suspect = isinstance(raw, str) or SURROGATE_ESCAPE.search(text) is not None
    return suspect and not valid_unicode(json.dumps(data, ensure_ascii=False))


def _custom_id(data: dict) -> str | None:
    value = data.get("custom_id")
    return value if isinstance(value, str) and value else None


class BatchValidator:
    """Validates a file's lines in order; a custom_id already claimed by an earlier line (valid or not) is an error,
    so each custom_id has exactly one record across the output and error files."""

    def __init__(self) -> None:
        self.first_line: dict[str, int] = {}

    def validate(self, raw: str | bytes, line: int) -> BatchRequest | LineError:
        result = parse_line(raw, line)
        custom_id = result.custom_id
        if custom_id is None:
            return result
        first = self.first_line.setdefault(custom_id, line)
        if first != line:
            return line_error(line, "duplicate_custom_id", f"{custom_id!r} is already used by line {first}",
                              custom_id, "custom_id")
        return result


_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
          "unsupported_value": "unsupported_value"}
_FIELD_CODES = {("url",): "invalid_url", ("method",): "invalid_method"}
_DETAILS = {"missing": "required field is missing", "extra_forbidden": "unknown field"}


def _validation_error(error: ValidationError, line: int, custom_id: str | None, prefix: tuple) -> LineError:
    problems = error.errors(include_url=False)
    described = []
    for p in problems:
        loc = ".".join(str(part) for part in prefix + p["loc"])
        detail = _DETAILS.get(p["type"], p["msg"])
        if p["type"] not in _DETAILS and not isinstance(p["input"], dict | list):
            detail += f" (got {json.dumps(p['input'])})"
        described.append(f"{loc}: {detail}" if loc else detail)
    first = problems[0]
    code = _FIELD_CODES.get(first["loc"]) or _CODES.get(first["type"], "invalid_value")
    param = ".".join(str(part) for part in prefix + first["loc"]) or None
    return LineError(line, code, f"line {line}: " + "; ".join(described), custom_id, param)


