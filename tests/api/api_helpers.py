"""Helpers for the API tests: batch lines, and finishing requests the way a worker does (through the store)."""

from __future__ import annotations

import json

from sqlalchemy import select

from sluice.api import store
from sluice.api.batch_lines import CHAT_URL
from sluice.api.settings import Settings
from sluice.api.tables import Request

MODEL = "tiny"
TEST_SETTINGS = Settings(max_file_bytes=100_000, max_batch_lines=50, models=(MODEL,))  # small, to test the limits


def chat(custom_id: str, content: str = "Hello", model: str | None = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {**({"model": model} if model else {}), "messages": [{"role": "user", "content": content}],
                     **body}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def request_ids(sessions, batch_id: str) -> dict[str, int]:
    """custom_id -> request id of the batch's valid lines."""
    with sessions.begin() as session:
        rows = session.execute(select(Request.custom_id, Request.id).where(Request.batch_id == batch_id,
                                                                           Request.custom_id.is_not(None)))
        return dict(rows.all())


def answer(text: str) -> dict:
    return {"object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def finish(sessions, ids: list[int], texts: dict[int, str] | None = None, failed: tuple[int, ...] = (),
           worker: str = "w1") -> None:
    """Claim and finish requests as a worker does: a response (text) for each id, or an error for those in failed."""
    with sessions.begin() as session:
        store.claim(session, ids, worker, 60)
    results = [store.RequestResult(i, status_code=400, error={"code": "invalid_prompt", "message": "refused",
                                                               "param": "body.messages"})
               if i in failed else
               store.RequestResult(i, response=answer((texts or {}).get(i, f"answer {i}")), prompt_tokens=5,
                                   cached_tokens=1, completion_tokens=2, ttft_seconds=0.05, e2e_seconds=0.4,
                                   gpu_seconds=0.5)
               for i in ids]
    with sessions.begin() as session:
        store.write_results(session, results, worker)
