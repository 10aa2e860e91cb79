"""The whole service with the official `openai` SDK: a live API server, a real GPU worker process, the webhooks
worker process, PostgreSQL and Redis; and `sluice serve` alone on SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from processes import engine_child, thread_cpus
from servers import Receiver, serve_app, start_sluice_serve

from sluice.api import store
from sluice.api.server import create_app
from sluice.api.settings import Settings
from sluice.worker.engine import LLM, SamplingParams

QUESTIONS = [f"Question {i}: is simple better than complex? {'Explain. ' * (i % 4)}" for i in range(10)]


def chat_line(i: int, max_tokens: int = 8, **body) -> dict:
    return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[i % 10]}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def upload(client: openai.OpenAI, lines: list) -> str:
    data = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    return client.files.create(file=("input.jsonl", data), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.25)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def expected_texts(llm: LLM, lines: list[dict]) -> dict[str, str]:
    return {line["custom_id"]: llm.chat(line["body"]["messages"], SamplingParams(
        max_tokens=line["body"]["max_tokens"], temperature=0))[0].text for line in lines}


@pytest.fixture
def live(cluster, monkeypatch):
    """The API server over the cluster's database and broker, a key, and the webhooks worker process."""
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")
    with cluster.sessions.begin() as session:
        _, key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)
    env = {**cluster.env(), "SLUICE_WEBHOOK_ALLOW_PRIVATE": "1"}
    log = (cluster.logs / "webhooks.log").open("w")
    hooks = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sluice.worker.celery_app", "worker", "-Q",
                              "webhooks", "-P", "threads", "-c", "2", "--without-gossip", "--without-mingle",
                              "--loglevel", "WARNING"], env=env, stdout=log, stderr=subprocess.STDOUT)
    with serve_app(create_app(cluster.sessions, cluster.app, Settings(models=("tiny",)))) as url:
        yield url, key
    hooks.kill()
    hooks.wait()


def test_openai_sdk_end_to_end(cluster, live, llama_dir):
    url, key = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    receiver = Receiver([])
    endpoint = httpx.post(f"{url}/v1/webhook_endpoints", headers={"Authorization": f"Bearer {key}"},
                          json={"url": receiver.url, "events": ["batch.completed", "batch.cancelled"]}).json()
    cluster.start_worker("--max-num-seqs", "4")

    good = [chat_line(i, 4 + i % 6) for i in range(10)]
    file_id = upload(client, [*good[:5], '{"custom_id": "broken", "method": "POST"', *good[5:]])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "e2e"})
    batch = wait_for(client, batch.id, ("completed",))
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (11, 10, 1)
    assert batch.metadata == {"job": "e2e"} and batch.usage.output_tokens > 0

    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
    assert got == expected_texts(LLM(str(llama_dir)), good)
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [(None, 6)]

    deadline = time.time() + 30
    while not receiver.received and time.time() < deadline:
        time.sleep(0.2)
    headers, body = receiver.received[0]
    event = openai.OpenAI(api_key="unused", webhook_secret=endpoint["secret"]).webhooks.unwrap(body, headers)
    assert event.type == "batch.completed" and event.data.id == batch.id
    receiver.close()

    more = [client.batches.create(input_file_id=upload(client, [chat_line(i, 2)]), endpoint="/v1/chat/completions",
                                  completion_window="24h").id for i in range(4)]
    seen, after = [], None
    while True:
        page = client.batches.list(limit=2, **({"after": after} if after else {}))
        seen += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert sorted(seen) == sorted([batch.id, *more]) and len(seen) == 5

    long = [chat_line(i, 500, ignore_eos=True) | {"custom_id": f"long{i}"} for i in range(40)]
    doomed = client.batches.create(input_file_id=upload(client, long), endpoint="/v1/chat/completions",
                                   completion_window="24h")
    assert client.batches.cancel(doomed.id).status in ("cancelling", "cancelled")
    doomed = wait_for(client, doomed.id, ("cancelled",), timeout=60)
    assert doomed.request_counts.completed < 40 and doomed.cancelled_at is not None


def test_penalties_and_logit_bias_through_the_service(cluster, live, llama_dir):
    """Mixed lines through the REST API and a GPU worker: plain, penalties, logit_bias, min_tokens, and a logit_bias
    id outside the vocabulary, which fails its own line only (found by the worker, which has the model)."""
    url, key = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    cluster.start_worker("--max-num-seqs", "4")
    llm = LLM(str(llama_dir))
    vocab, eos = llm.model_config.vocab_size, llm.tokenizer.eos_token_id
    settings = {"plain": {}, "pen": dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
                "bias": dict(logit_bias={40: 5.0, eos: -100.0}), "min": dict(min_tokens=4, logit_bias={eos: 100.0})}
    lines = [chat_line(i, 6, **{k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
                                for k, v in kwargs.items()}) | {"custom_id": name}
             for i, (name, kwargs) in enumerate(settings.items())]
    lines.append(chat_line(4, 6, logit_bias={"3": 1, str(vocab): 2}) | {"custom_id": "bad"})
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_for(client, batch.id, ("completed",))
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
    expected = {line["custom_id"]: llm.chat(line["body"]["messages"], SamplingParams(
        max_tokens=6, temperature=0, **settings[line["custom_id"]]))[0].text for line in lines[:4]}
    assert got == expected and len(set(expected.values())) == 4
    [error] = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "bad", error
    assert (error["error"]["code"], error["error"]["param"], error["error"]["line"]) == \
        ("invalid_value", "body.logit_bias", 5), error
    assert f"token id {vocab}, outside the model's vocabulary [0, {vocab})" in error["error"]["message"]


def test_sluice_serve_on_sqlite_with_the_sdk(tmp_path, llama_dir):
    proc, port = start_sluice_serve(tmp_path, "--model", str(llama_dir), "--served-model-name", "tiny")
    try:
        if len(os.sched_getaffinity(0)) > 1:  # the API's threads keep off the CPU engine's CPUs, as the worker's do
            engine, serving = engine_child(proc.pid), thread_cpus(proc.pid)
            assert not set().union(*thread_cpus(engine)) & set().union(*serving), (engine, serving)
        key = (tmp_path / "data" / "api_key").read_text().strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        lines = [chat_line(i, 3 + i) for i in range(6)]
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        batch = wait_for(client, batch.id, ("completed",), timeout=60)
        outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
        assert got == expected_texts(LLM(str(llama_dir)), lines)
        assert (tmp_path / "data" / "sluice.db").exists()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
