"""Helpers for the store tests: batch lines, a submitted batch, worker results."""

from __future__ import annotations

import base64
import json

from sluice.api import store
from sluice.api.batch_lines import CHAT_URL, COMPLETIONS_URL

MODEL = "tiny"


def chat(custom_id: str, content: str = "Hello", model: str | None = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {**({"model": model} if model else {}), "messages": [{"role": "user", "content": content}],
                     **body}}


def completion(custom_id: str, prompt: str = "Once", model: str | None = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL,
            "body": {**({"model": model} if model else {}), "prompt": prompt, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def submit(sessions, lines: list | bytes, tenant: str = "acme", **kwargs) -> tuple:
    """Store a file and create a batch from it in one transaction: (batch, work)."""
    data = lines if isinstance(lines, bytes) else jsonl(lines)
    with sessions.begin() as session:
        return store.submit_jsonl(session, tenant, "input.jsonl", data, **kwargs)


def ok(request_id: int, text: str = "hi", prompt_tokens: int = 5, cached_tokens: int = 1,
       completion_tokens: int = 3, gpu_seconds: float = 0.5) -> store.RequestResult:
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": "stop"}]}
    return store.RequestResult(request_id, response=body, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                               completion_tokens=completion_tokens, queue_seconds=0.1, ttft_seconds=0.2,
                               e2e_seconds=0.3, gpu_seconds=gpu_seconds)


def failed(request_id: int, line: int, code: str = "invalid_prompt") -> store.RequestResult:
    return store.RequestResult(request_id, status_code=400,
                               error={"code": code, "message": f"line {line}: refused", "param": "body.messages"})


def batch_row(sessions, batch_id: str):
    with sessions.begin() as session:
        return store.get_batch(session, batch_id)


def statuses(sessions, batch_id: str) -> dict[int, str]:
    from sqlalchemy import select

    from sluice.api.tables import Request

    with sessions.begin() as session:
        return dict(session.execute(select(Request.id, Request.status).where(Request.batch_id == batch_id)).all())


def read_chunks(redis, key: str) -> list[dict]:
    """The chunk messages in a Redis list, oldest first: task name, priority and request ids."""
    chunks = []
    for raw in reversed(redis.lrange(key, 0, -1)):  # LPUSH puts the newest first
        envelope = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        chunks.append({"task": envelope["headers"]["task"], "priority": envelope["properties"]["priority"],
                       "ids": args[0]})
    return chunks
