"""One batch through the whole service with the openai SDK: a live API over the cluster's store and queue, a GPU
worker started on it, the file uploaded, the batch created and polled until it completes, its output and error lines
read back."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import openai
from servers import serve_app

from sluice.api import store
from sluice.api.server import create_app
from sluice.api.settings import Settings


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 60,
                     "temperature": 0, **body}}


@dataclass
class Ran:
    batch: openai.types.Batch
    outputs: dict[str, dict]  # custom_id -> the response body
    errors: dict[str, dict]  # custom_id -> the error


def run_batch(cluster, lines: list[dict], timeout: float = 120) -> Ran:
    with cluster.sessions.begin() as session:
        _, key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)
    with serve_app(create_app(cluster.sessions, cluster.app, Settings(models=("tiny",)))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        cluster.start_worker("--max-num-seqs", "4")
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("input.jsonl", data), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + timeout
        while (batch := client.batches.retrieve(batch.id)).status != "completed" and time.time() < deadline:
            time.sleep(0.25)
        outputs = {o["custom_id"]: o["response"]["body"] for o in _lines(client, batch.output_file_id)}
        errors = {e["custom_id"]: e["error"] for e in _lines(client, batch.error_file_id)}
    return Ran(batch, outputs, errors)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []
