"""What the REST API reads and writes through the store, on PostgreSQL and SQLite: cursor pages, file deletion and
upload checks, single requests, result pages, keys by prefix, the outbox's new and due deliveries, metric sums."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select, update
from store_test_utils import chat, jsonl, ok, submit
from test_leases import claim, write

from sluice.api import store
from sluice.api.tables import Batch, File, FileContent, Request, Result, WebhookDelivery


def test_file_pages_are_ordered_with_a_cursor(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        other = store.get_or_create_tenant(session, "globex")
        ids = [store.store_file(session, tenant.id, f"{i}.jsonl", "batch", b"{}\n").id for i in range(5)]
        session.execute(update(File).values(created_at=100.0))  # equal times: the id breaks ties
        store.store_file(session, other.id, "theirs.jsonl", "batch", b"{}\n")
    newest_first = sorted(ids, reverse=True)
    with sessions.begin() as session:
        page, more = store.list_files(session, tenant.id, None, 2)
        assert [f.id for f in page] == newest_first[:2] and more
        page, more = store.list_files(session, tenant.id, page[-1].id, 10)
        assert [f.id for f in page] == newest_first[2:] and not more
        page, _ = store.list_files(session, tenant.id, sorted(ids)[1], 10, order="asc")
        assert [f.id for f in page] == sorted(ids)[2:]
        assert store.list_files(session, tenant.id, None, 10, purpose="fine-tune") == ([], False)
        with pytest.raises(store.InvalidInput, match="after"):
            store.list_files(session, other.id, ids[0], 10)  # another tenant's id is no cursor


def test_deleting_a_file_keeps_its_batches(sessions):
    batch, _ = submit(sessions, [chat("a")])
    with sessions.begin() as session:
        store.delete_file(session, batch.input_file_id, batch.tenant_id)
        assert session.scalar(select(File.id)) is None and session.scalar(select(FileContent.file_id)) is None
        assert store.get_batch(session, batch.id).input_file_id == batch.input_file_id
        with pytest.raises(store.NotFound):
            store.delete_file(session, batch.input_file_id, batch.tenant_id)


@pytest.mark.parametrize("data, code", [(b"", "empty_file"), (b"\n \n", "empty_file"), (b"a,b\n1,2\n", "invalid_jsonl"),
                                        (b"[1]\n2\n", "invalid_jsonl"), (jsonl([chat(str(i)) for i in range(4)]),
                                                                         "too_many_lines"),
                                        (b"[" * 5000 + b"\n", "invalid_jsonl"),
                                        (b'{"a": "\xed\xa0\x80"}', "invalid_jsonl")])
def test_input_file_problems(data, code):
    assert store.input_file_problem(data, max_lines=3)["code"] == code


def test_a_usable_file_has_no_problem():
    assert store.input_file_problem(jsonl(["{bad", chat("a")]), max_lines=3) is None


def test_a_single_request_is_a_one_request_batch_outside_lists_and_webhooks(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        store.create_webhook_endpoint(session, tenant.id, "https://example.com/hook")
        batch, work = store.create_request(session, tenant.id, "/v1/chat/completions", chat("x")["body"])
    assert batch.id.startswith(store.REQUEST_PREFIX) and (work.model, len(work.request_ids)) == ("tiny", 1)
    with sessions.begin() as session:
        assert store.request_view(session, batch)["status"] == "queued"
        assert store.list_batches(session, tenant.id, None, 10) == ([], False)
    claim(sessions, work.request_ids, "w1")
    write(sessions, [ok(work.request_ids[0], text="hi")], "w1")
    with sessions.begin() as session:
        view = store.request_view(session, session.get(Batch, batch.id))
        assert view["status"] == "completed" and view["usage"]["total_tokens"] == 8
        assert view["response"]["choices"][0]["message"]["content"] == "hi"
        assert session.scalar(select(WebhookDelivery.id)) is None  # no batch.completed for a single request


@pytest.mark.parametrize("endpoint, body, param", [
    ("/v1/embeddings", {"model": "tiny", "input": "x"}, "endpoint"),
    ("/v1/completions", {"prompt": "x"}, "body.model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True}, "body.stream"),
])
def test_bad_single_requests_store_nothing(sessions, endpoint, body, param):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
    with pytest.raises(store.InvalidInput) as refused, sessions.begin() as session:
        store.create_request(session, tenant.id, endpoint, body)
    assert refused.value.param == param and not str(refused.value).startswith("line")
    with sessions.begin() as session:
        assert session.scalar(select(Batch.id)) is None


def test_result_pages_follow_finishing_order(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), "{bad", chat("c")])
    a, b, c = work.request_ids
    claim(sessions, work.request_ids, "w1")
    write(sessions, [ok(c)], "w1")
    write(sessions, [ok(a)], "w1")
    with sessions.begin() as session:
        page, more = store.result_page(session, batch.id, None, 2)
        assert [(r["line"], r["custom_id"]) for r in page] == [(3, None), (4, "c")] and more
        assert page[0]["error"]["code"] == "invalid_json_line" and page[1]["response"]["status_code"] == 200
        page, more = store.result_page(session, batch.id, 4, 10)
        assert [r["line"] for r in page] == [1] and not more
        with pytest.raises(store.InvalidInput, match="line 2 has no result"):
            store.result_page(session, batch.id, 2, 10)
        assert [line for line, _ in store.file_page(session, batch.id, "output", 1, 10)] == [4]
        assert [line for line, _ in store.file_page(session, batch.id, "error", 0, 10)] == [3]


def test_keys_are_found_by_id_or_unique_prefix(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        first, _ = store.create_api_key(session, tenant.id)
        second, _ = store.create_api_key(session, tenant.id)
        assert store.find_api_key(session, first.id).id == first.id
        assert store.find_api_key(session, second.prefix).id == second.id
        second.prefix = first.prefix
        session.flush()
        with pytest.raises(store.InvalidInput, match="give the key id"):
            store.find_api_key(session, first.prefix)
        with pytest.raises(store.NotFound):
            store.find_api_key(session, "sk-sluice-none")


def test_new_and_due_deliveries(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        endpoint = store.create_webhook_endpoint(session, tenant.id, "https://example.com/hook")
        file = store.store_file(session, tenant.id, "in.jsonl", "batch", b"\n")
        store.create_batch(session, tenant.id, file.id)  # empty: fails, and notifies
        [new] = store.new_deliveries(session)
    with sessions.begin() as session:
        assert store.new_deliveries(session) == []  # a new session has written none
        assert store.due_deliveries(session, time.time()) == [new]
        page, more = store.list_deliveries(session, endpoint.id, tenant.id, None, 10)
        assert [d.id for d in page] == [new] and not more
        with pytest.raises(store.NotFound):
            store.list_deliveries(session, endpoint.id, tenant.id + 1, None, 10)
        store.delete_webhook_endpoint(session, endpoint.id, tenant.id)
        assert store.due_deliveries(session, time.time()) == []


def test_metric_sums(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c")])
    a, b, c = work.request_ids
    claim(sessions, [a, b], "w1")
    write(sessions, [ok(a, prompt_tokens=7, completion_tokens=3)], "w1")
    with sessions.begin() as session:
        session.execute(update(Result).values(ttft_seconds=0.2))
        assert store.requests_by_status(session, ("queued", "running")) == {("tiny", "queued"): 1,
                                                                           ("tiny", "running"): 1}
        with pytest.raises(ValueError, match=r"no index serves requests of status \['completed'\]"):
            store.requests_by_status(session, ("queued", "completed"))
        assert store.token_totals(session) == {"tiny": (7, 3)}
        assert store.latency_histogram(session, Result.ttft_seconds, (0.1, 0.5)) == {"tiny": ([0, 1], 0.2, 1)}
        assert store.latency_histogram(session, Result.e2e_seconds, (1.0,)) == {"tiny": ([1], 0.3, 1)}
        assert session.scalar(select(Request.status).where(Request.id == c)) == "queued"
