"""/v1/batches with the openai SDK: create, get, list across pages, cancel; output and error files in OpenAI's line
format (partial while running); result pages, efficiency and usage; refusals that store nothing."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from api_helpers import chat, finish, jsonl, request_ids
from sqlalchemy import select

from sluice.api import store
from sluice.api.queue import model_queue, queue_depth
from sluice.api.tables import EfficiencyWindow, Request


def upload(client, lines) -> str:
    return client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch").id


def create(client, lines, **kwargs):
    return client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                 completion_window="24h", **kwargs)


def test_create_get_and_download_output_and_error_files(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    batch = create(client, [chat("a"), "{oops", chat("b"), chat("c", max_tokens=0), chat("d")],
                   metadata={"run": "7"})
    assert batch.id.startswith("batch_") and batch.status == "in_progress" and batch.model == "tiny"
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 0, "failed": 2}
    assert batch.metadata == {"run": "7"} and batch.endpoint == "/v1/chat/completions"
    assert batch.output_file_id is None and batch.error_file_id == f"file-err-{batch.id}"
    assert queue_depth(api.celery, model_queue("tiny")) == 1  # published: one chunk of the three valid lines

    ids = request_ids(api.sessions, batch.id)
    finish(api.sessions, [ids["b"]], {ids["b"]: "B"})
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.output_file_id == f"file-out-{batch.id}"
    partial = client.files.content(running.output_file_id).text.splitlines()
    assert [json.loads(line)["custom_id"] for line in partial] == ["b"]

    finish(api.sessions, [ids["d"], ids["a"]], {ids["a"]: "A", ids["d"]: "D"})
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at and done.request_counts.completed == 3
    assert done.usage.input_tokens == 15 and done.usage.output_tokens == 6
    outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"], o["response"]["body"]["choices"][0]["message"]["content"])
            for o in outputs] == [("a", 200, "A"), ("b", 200, "B"), ("d", 200, "D")]
    assert all(o["id"].startswith("batch_req_") and o["error"] is None for o in outputs)
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        (None, "invalid_json_line", 2), ("c", "invalid_value", 4)]
    assert errors[1]["response"] is None and "max_tokens" in errors[1]["error"]["message"]
    meta = client.files.retrieve(done.output_file_id)
    assert (meta.purpose, meta.filename) == ("batch_output", f"{batch.id}_output.jsonl")
    assert meta.bytes == len(client.files.content(done.output_file_id).content)


def test_list_pages_across_pages(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    ids = [create(client, [chat("a")]).id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]
    last = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in last.data] == [ids[0]] and last.has_more is False


def test_cancel(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    batch = create(client, [chat("a"), chat("b")])
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.cancelling_at
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no error
    finished = create(client, [chat("a")])
    finish(api.sessions, list(request_ids(api.sessions, finished.id).values()))
    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(finished.id)
    assert "is completed" in refused.value.body["message"] and refused.value.body["code"] == "conflict"


@pytest.mark.parametrize("change, status, param, words", [
    ({"endpoint": "/v1/embeddings"}, 400, "endpoint", "not supported"),
    ({"completion_window": "soon"}, 400, "completion_window", "give hours"),
    ({"input_file_id": "file-nope"}, 404, None, "file file-nope not found"),
    ({"metadata": {"k": "v" * 600}}, 400, "metadata", "at most 512"),
    ({"metadata": {"k": 1}}, 400, "metadata.k", "valid string"),
    ({"priority": 1}, 400, "priority", "unknown field"),
    ({"endpoint": None}, 400, "endpoint", "valid string"),
])
def test_refused_batches_store_nothing(api, tenant_key, openai_client, change, status, param, words):
    client = openai_client(tenant_key())
    body = {"input_file_id": upload(client, [chat("a")]), "endpoint": "/v1/chat/completions",
            "completion_window": "24h", **change}
    before = api.counts()
    response = httpx.post(f"{api.url}/v1/batches", json=body, headers={"Authorization": f"Bearer {client.api_key}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert api.counts() == before and api.redis.dbsize() == 0


@pytest.mark.parametrize("content, message", [
    (b"{not json", "the request body is not valid JSON"),
    (b"[1, 2]", "the request body: Input should be a valid dictionary"),
    (b"", "the request body: required field is missing"),
])
def test_malformed_bodies_are_400(api, tenant_key, content, message):
    response = httpx.post(f"{api.url}/v1/batches", content=content, headers={
        "Authorization": f"Bearer {tenant_key()}", "content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(message)
    assert response.json()["error"]["param"] is None


def test_unknown_model_is_refused_until_a_worker_serves_it(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    file_id = upload(client, [chat("a", model="big")])
    before = api.counts()
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.body["code"] == "model_not_found" and "'big'" in refused.value.body["message"]
    assert "known: tiny" in refused.value.body["message"] and api.counts() == before
    with api.sessions.begin() as session:
        store.heartbeat(session, "w-big", hostname="h", pid=1, model="/models/big", served_model_name="big")
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.model == "big" and batch.waiting_for_worker is False


def test_lora_adapters_are_listed_and_batches_mix_them_with_their_base_model(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    with api.sessions.begin() as session:
        store.heartbeat(session, "w-base", hostname="h", pid=1, model="/models/base", served_model_name="base",
                        adapters={"a": "/adapters/a", "b": "/adapters/b"})
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert set(models) == {"tiny", "base", "a", "b"}  # tiny: SLUICE_MODELS, no live worker
    assert (models["a"]["parent"], models["a"]["root"], models["a"]["object"]) == ("base", "/adapters/a", "model")
    assert (models["base"]["parent"], models["base"]["root"]) == (None, "/models/base")
    assert (models["tiny"]["parent"], models["tiny"]["root"]) == (None, None)
    assert client.models.retrieve("b").model_dump()["parent"] == "base"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("c")

    mixed = create(client, [chat("1", model="a"), chat("2", model="base"), chat("3", model="b"), chat("4", model="c"),
                            chat("5", model="tiny")])
    assert mixed.model == "base" and mixed.waiting_for_worker is False  # the base's queue: every line can run there
    assert mixed.request_counts.failed == 2 and queue_depth(api.celery, model_queue("base")) == 1
    with api.sessions.begin() as session:  # each stored body keeps the name it runs under
        bodies = {r.custom_id: r.body for r in session.scalars(select(Request).where(Request.batch_id == mixed.id))}
    assert [bodies[i]["model"] for i in "123"] == ["a", "base", "b"]
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, client.files.content(mixed.error_file_id).text
                                                      .splitlines())}
    assert set(errors) == {"4", "5"} and "one base model and LoRA adapters" in errors["4"]["message"]

    alone = create(client, [chat("1", model="b"), chat("2", model="b")])  # an adapter's own queue, as a model's
    assert alone.model == "b" and queue_depth(api.celery, model_queue("b")) == 1
    file_id = upload(client, [chat("1", model="c")])
    with pytest.raises(openai.BadRequestError) as refused:  # an unknown adapter, as an unknown model
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.body["code"] == "model_not_found"
    assert "known: a, b, base, tiny" in refused.value.body["message"]


def test_unusable_file_makes_a_failed_batch_with_errors(api, tenant_key, openai_client):
    # a file uploaded under a larger limit (here: straight through the store) is checked again by the batch
    key = tenant_key()
    with api.sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        file = store.store_file(session, tenant.id, "big.jsonl", "batch", jsonl([chat(str(i)) for i in range(60)]))
    client = openai_client(key)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at and batch.model is None  # not "": no line named one
    [error] = batch.errors.data
    assert (error.code, error.line) == ("too_many_lines", 51) and "at most 50" in error.message
    invalid = create(client, ["not json", chat("b", model="")])  # every line refused: a batch of error lines only
    assert invalid.request_counts.failed == 2 and invalid.model is None


def test_unknown_batch_ids_are_404(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    for call in (client.batches.retrieve, client.batches.cancel):
        with pytest.raises(openai.NotFoundError) as missing:
            call("batch_nope")
        assert missing.value.body["message"] == "batch batch_nope not found"
    response = httpx.get(f"{api.url}/v1/batches", params={"after": "batch_nope"},
                         headers={"Authorization": f"Bearer {client.api_key}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    response = httpx.get(f"{api.url}/v1/batches", params={"limit": 101},
                         headers={"Authorization": f"Bearer {client.api_key}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "limit"


def test_result_pages_follow_finishing_order(api, tenant_key, openai_client):
    key = tenant_key()
    batch = create(openai_client(key), [chat("a"), chat("b"), chat("c"), "{bad"])
    ids = request_ids(api.sessions, batch.id)
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{api.url}/v1/batches/{batch.id}/results"
    first = httpx.get(url, params={"limit": 1}, headers=headers).json()
    assert [r["line"] for r in first["data"]] == [4] and first["data"][0]["error"]["code"] == "invalid_json_line"
    assert first["has_more"] is False and first["last_line"] == 4
    finish(api.sessions, [ids["c"]])
    finish(api.sessions, [ids["a"]], failed=(ids["a"],))
    page = httpx.get(url, params={"after": 4}, headers=headers).json()
    assert [(r["line"], r["custom_id"]) for r in page["data"]] == [(3, "c"), (1, "a")]
    assert page["data"][0]["response"]["status_code"] == 200 and page["data"][1]["error"]["code"] == "invalid_prompt"
    empty = httpx.get(url, params={"after": 1}, headers=headers).json()
    assert empty == {"object": "list", "data": [], "has_more": False, "last_line": 1}
    response = httpx.get(url, params={"after": 2}, headers=headers)  # line 2 has no result yet
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"


def test_efficiency_and_usage(api, tenant_key, openai_client):
    key = tenant_key()
    batch = create(openai_client(key), [chat("a"), chat("b")])
    now = time.time()
    with api.sessions.begin() as session:
        store.heartbeat(session, "w1", hostname="h", pid=1, model="/m", served_model_name="tiny")
        for start, model in ((now - 3600, "tiny"), (now - 1, "tiny"), (now - 1, "other")):
            store.record_efficiency(session, EfficiencyWindow(
                worker_id="w1", model=model, window_start=start, window_end=start + 10, steps=10, prefill_tokens=50,
                decode_tokens=20, mean_running_seqs=2.0, max_running_seqs=2, max_num_seqs=8, token_budget_use=0.3,
                kv_cache_use=0.25, preemptions=0, prefix_cache_queries=40, prefix_cache_hits=10, busy_seconds=8.0,
                idle_seconds=2.0))
    finish(api.sessions, list(request_ids(api.sessions, batch.id).values()))
    headers = {"Authorization": f"Bearer {key}"}
    report = httpx.get(f"{api.url}/v1/batches/{batch.id}/efficiency", headers=headers).json()
    assert report["model"] == "tiny" and [w["window_start"] for w in report["data"]] == [now - 1]
    assert report["data"][0]["kv_cache_use"] == 0.25 and report["end"] >= report["start"]

    usage = httpx.get(f"{api.url}/v1/usage", headers=headers).json()
    assert usage["tenant"] == "acme" and [row["batch_id"] for row in usage["data"]] == [batch.id]
    assert usage["total"]["requests"] == 2 and usage["total"]["prompt_tokens"] == 10
    assert usage["total"]["gpu_seconds"] == 1.0
    later = httpx.get(f"{api.url}/v1/usage", params={"start_time": int(now) + 60, "end_time": int(now) + 120},
                      headers=headers).json()
    assert later["data"] == [] and later["total"]["requests"] == 0
    response = httpx.get(f"{api.url}/v1/usage", params={"start_time": 10, "end_time": 5}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "end_time"


def test_lines_nested_too_deeply_or_with_lone_surrogates_are_readable_error_lines(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    # json.dumps writes each lone surrogate as its escape, \ud800; the pair in "d" is one character, and valid
    batch = create(client, [chat("a"), "[" * 5000 + "]" * 5000, chat("q\ud800"), chat("b", model="\ud800"),
                            chat("c", content="x\udfff"), chat("d", content="\U0001F600")])
    assert (batch.status, batch.request_counts.failed, batch.request_counts.total) == ("in_progress", 4, 6)
    assert sorted(request_ids(api.sessions, batch.id)) == ["a", "d"]
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["error"]["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (2, None, "invalid_json_line"), (3, "q\\ud800", "invalid_value"), (4, "b", "invalid_value"),
        (5, "c", "invalid_value")]
    assert "nested too deeply" in errors[0]["error"]["message"]
    assert all("lone UTF-16 surrogate" in e["error"]["message"] for e in errors[1:])
    assert client.files.retrieve(batch.error_file_id).bytes == len(client.files.content(batch.error_file_id).content)
    response = httpx.get(f"{api.url}/v1/batches/{batch.id}/results",
                         headers={"Authorization": f"Bearer {client.api_key}"})
    assert response.status_code == 200 and len(response.json()["data"]) == 4


def test_a_lone_surrogate_in_metadata_stores_nothing(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    body = {"input_file_id": upload(client, [chat("a")]), "endpoint": "/v1/chat/completions",
            "completion_window": "24h", "metadata": {"k": "\ud800"}}
    before = api.counts()
    # json.dumps escapes the surrogate, which httpx's own encoding (UTF-8) cannot hold
    response = httpx.post(f"{api.url}/v1/batches", content=json.dumps(body),
                          headers={"Authorization": f"Bearer {client.api_key}", "content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("metadata", "invalid_value") and "surrogate" in error["message"]
    assert api.counts() == before and api.redis.dbsize() == 0


def test_batch_ids_and_cursors_no_row_can_have_are_refused(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    create(client, [chat("a")])
    auth = {"Authorization": f"Bearer {client.api_key}"}
    for method, path in [("GET", "batches/%00"), ("GET", "batches/batch_%00"), ("POST", "batches/%00/cancel"),
                         ("GET", "batches/%00/results"), ("GET", "batches/%00/efficiency"),
                         ("GET", "requests/req_%00")]:
        response = httpx.request(method, f"{api.url}/v1/{path}", headers=auth)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", (method, path)
    response = httpx.get(f"{api.url}/v1/batches", params={"after": "\x00"}, headers=auth)
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    before = api.counts()
    for file_id in ("f\x00", "file-\ud800"):
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        response = httpx.post(f"{api.url}/v1/batches", content=json.dumps(body),
                              headers={**auth, "content-type": "application/json"})
        assert response.status_code == 404 and "not found" in response.json()["error"]["message"], response.text
    assert api.counts() == before and api.redis.dbsize() == 1  # the first batch's chunk


@pytest.mark.parametrize("path, params, param", [
    ("batches/{batch}/results", {"after": 2**31}, "after"),
    ("batches/{batch}/results", {"after": -2**31 - 5}, "after"),  # a 500 (DataError) before
    ("usage", {"start_time": -2**63 - 1}, "start_time"),
    ("usage", {"end_time": 10**20}, "end_time"),
    ("usage", {"start_time": 2**63}, "start_time"),
])
def test_integers_past_the_columns_range_are_400(api, tenant_key, openai_client, path, params, param):
    client = openai_client(tenant_key())
    batch = create(client, [chat("a")])
    response = httpx.get(f"{api.url}/v1/{path.format(batch=batch.id)}", params=params,
                         headers={"Authorization": f"Bearer {client.api_key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value") and "than or equal" in error["message"]
