"""Creating batches: every line validated, bad lines kept as error results, whole-file problems fail the batch and
store nothing else, request rows written in bulk, chunks published to the model's queue at the batch's priority."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import func, select
from store_test_utils import MODEL, batch_row, chat, completion, jsonl, read_chunks, submit

from sluice.api import queue, store
from sluice.api.batch_lines import BODIES, CHAT_URL, COMPLETIONS_URL
from sluice.api.tables import Request, Result, WebhookDelivery


def counts(sessions, batch_id: str) -> tuple[int, int]:
    with sessions.begin() as session:
        requests = session.scalar(select(func.count()).select_from(Request).where(Request.batch_id == batch_id))
        results = session.scalar(select(func.count()).select_from(Result).join(Request)
                                 .where(Request.batch_id == batch_id))
    return requests, results


def test_mixed_lines_queue_the_good_and_keep_the_bad_as_errors(sessions):
    lines = [chat("a"), "{not json", chat("b", max_tokens=0), chat("a"), "", completion("c"),
             {"custom_id": "d", "method": "GET", "url": CHAT_URL, "body": {}}, chat("e", stream=True), chat("f")]
    batch, work = submit(sessions, lines, metadata={"team": "search"}, priority=2)
    assert (batch.status, batch.endpoint, batch.model, batch.priority) == ("in_progress", CHAT_URL, MODEL, 2)
    # the blank line (5) is skipped but keeps the numbering
    assert (batch.request_total, batch.request_completed, batch.request_failed) == (8, 0, 6)
    assert counts(sessions, batch.id) == (8, 6)
    with sessions.begin() as session:
        rows = session.scalars(select(Request).where(Request.batch_id == batch.id).order_by(Request.line)).all()
        errors = {r.line: (r.status, r.custom_id, session.get(Result, r.id).error) for r in rows
                  if r.status == "failed"}
        queued = [r for r in rows if r.status == "queued"]
    ids = [r.id for r in queued]
    assert (work.model, work.priority, work.request_ids) == (MODEL, 2, ids)
    assert sorted(i for group in work.groups for i in group) == ids  # grouped by prompt prefix (api/prefix_order.py)
    assert [(r.line, r.custom_id) for r in queued] == [(1, "a"), (9, "f")]
    assert {line: e[2]["code"] for line, e in errors.items()} == {
        2: "invalid_json_line", 3: "invalid_value", 4: "duplicate_custom_id", 6: "invalid_url",
        7: "invalid_method", 8: "unsupported_value"}
    assert errors[4][1:] == (None, {"code": "duplicate_custom_id", "param": "custom_id", "custom_id": "a",
                                    "message": "line 4: custom_id: 'a' is already used by line 1"})
    assert "differs from the batch's endpoint" in errors[6][2]["message"]
    # stored bodies are the validated ones, and validate again as they are
    assert queued[0].body == {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    assert BODIES[CHAT_URL].model_validate(queued[0].body)


def test_batch_model_and_endpoint_come_from_the_first_valid_line_unless_given(sessions):
    batch, work = submit(sessions, [completion("x", model=None), completion("a", model="m1"),
                                    completion("b", model="m2"), chat("c", model="m1")])
    assert (batch.model, batch.endpoint, batch.request_failed) == ("m1", COMPLETIONS_URL, 3)
    assert len(work.request_ids) == 1
    given, work = submit(sessions, [completion("a", model=None), completion("b", model="other")], model="served",
                         endpoint=COMPLETIONS_URL)
    assert (given.model, given.request_failed, work.model, len(work.request_ids)) == ("served", 0, "served", 2)


@pytest.mark.parametrize("data, code", [
    (b"", "empty_file"), (b"\n  \n\n", "empty_file"), (b"hello\nworld\n", "invalid_jsonl"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "invalid_jsonl"), (b"[1, 2]\n", "invalid_jsonl"),
    (jsonl([chat(str(i)) for i in range(4)]), "too_many_lines")])
def test_unusable_file_fails_the_batch_and_stores_no_requests(sessions, data, code):
    with sessions.begin() as session:
        store.create_webhook_endpoint(session, store.get_or_create_tenant(session, "acme").id,
                                      "https://example.com/hook", ["batch.failed"])
    batch, work = submit(sessions, data, max_lines=3)
    assert work is None
    assert (batch.status, batch.errors[0]["code"], batch.failed_at is not None) == ("failed", code, True)
    assert counts(sessions, batch.id) == (0, 0)
    with sessions.begin() as session:
        view = store.batch_view(session, store.get_batch(session, batch.id))
        assert session.scalars(select(WebhookDelivery.event_type)).all() == ["batch.failed"]
    assert view["errors"]["data"][0]["code"] == code and view["status"] == "failed"
    assert view["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_values_the_database_cannot_hold_are_bad_lines_not_a_failed_transaction(sessions):
    lines = [chat("x" * 513), chat("nul\x00"), chat("a", model="m\x00"), chat("b", model="m" * 256),
             chat("c", model=" "), chat("ok")]
    batch, work = submit(sessions, lines)
    assert (batch.request_failed, len(work.request_ids)) == (5, 1)
    with sessions.begin() as session:
        errors = [e["error"] for e in store.error_lines(session, batch.id)]
    assert [(e["param"], e["code"]) for e in errors] == [("custom_id", "invalid_value")] * 2 + [
        ("body.model", "invalid_value")] * 3
    with pytest.raises(store.InvalidInput, match="model name"):
        submit(sessions, [chat("a")], model="x" * 256)


def test_lines_too_deep_not_utf8_or_with_lone_surrogates_are_bad_lines(sessions):
    # json.dumps writes a lone surrogate as its escape (\\ud800); bytes that encode one are not UTF-8
    data = (b"\xef\xbb\xbf" + jsonl([chat("a"), "[" * 5000 + "]" * 5000, chat("q\ud800"), chat("b", content="\udfff"),
                                   chat("c", content="\U0001F600")]) + b'{"custom_id": "d\xed\xa0\x80"}\n')
    batch, work = submit(sessions, data)
    assert (batch.status, batch.request_total, batch.request_failed, len(work.request_ids)) == ("in_progress", 6, 4, 2)
    with sessions.begin() as session:
        errors = [e["error"] for e in store.error_lines(session, batch.id)]
        custom_ids = [e["custom_id"] for e in store.error_lines(session, batch.id)]
        queued = session.scalars(select(Request.body).where(Request.batch_id == batch.id, Request.status == "queued"))
        assert [body["messages"][0]["content"] for body in queued.all()] == ["Hello", "\U0001F600"]
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line"), (3, "invalid_value"),
                                                        (4, "invalid_value"), (6, "invalid_json_line")]
    assert "nested too deeply" in errors[0]["message"] and "not UTF-8" in errors[3]["message"]
    assert "lone UTF-16 surrogate escape" in errors[1]["message"] and custom_ids == [None, "q\\ud800", "b", None]
    json.dumps(errors, ensure_ascii=False).encode()  # UTF-8 holds every error: the error file can be downloaded


def test_a_file_of_only_bad_lines_completes_at_once(sessions):
    batch, work = submit(sessions, [chat("a", max_tokens=-1), "{}"])
    assert work is None
    assert (batch.status, batch.request_total, batch.request_failed) == ("completed", 2, 2)


@pytest.mark.parametrize("kwargs, param", [
    (dict(priority=10), "priority"), (dict(completion_window="1d"), "completion_window"),
    (dict(endpoint="/v1/embeddings"), "endpoint"), (dict(metadata={"k": "v" * 513}), "metadata"),
    (dict(metadata={str(i): "" for i in range(17)}), "metadata"), (dict(metadata={"k": "\ud800"}), "metadata")])
def test_bad_arguments_are_refused_and_store_nothing(sessions, kwargs, param):
    with pytest.raises(store.InvalidInput, match=param) as refused:
        submit(sessions, [chat("a")], **kwargs)
    assert refused.value.param == param
    with sessions.begin() as session:
        assert session.scalar(select(func.count()).select_from(Request)) == 0


def test_unknown_or_foreign_input_file_is_not_found(sessions):
    with sessions.begin() as session:
        mine, theirs = store.get_or_create_tenant(session, "mine"), store.get_or_create_tenant(session, "theirs")
        file = store.store_file(session, theirs.id, "in.jsonl", "batch", jsonl([chat("a")]))
        with pytest.raises(store.NotFound, match=file.id):
            store.create_batch(session, mine.id, file.id)
        with pytest.raises(store.NotFound, match="file-nope"):
            store.create_batch(session, mine.id, "file-nope")


def test_chunks_go_to_the_models_queue_with_the_batch_priority(sessions, broker):
    batch, work = submit(sessions, [chat(str(i)) for i in range(70)], priority=3)
    urgent, urgent_work = submit(sessions, [chat("now")], priority=0)
    app = queue.make_app()
    assert queue.publish_chunks(app, [work], size=32) == 3
    assert queue.publish_chunks(app, [urgent_work]) == 1
    # kombu keeps one list per priority; a worker pops priority 0's list first, then 1's, ...
    assert sorted(k.decode() for k in broker.keys("model.*")) == ["model.tiny", "model.tiny:3"]
    chunks = read_chunks(broker, "model.tiny:3")
    assert [c["task"] for c in chunks] == [queue.RUN_CHUNK] * 3
    assert [c["priority"] for c in chunks] == [3] * 3
    assert [c["ids"] for c in chunks] == [work.request_ids[:32], work.request_ids[32:64], work.request_ids[64:]]
    assert [c["ids"] for c in read_chunks(broker, "model.tiny")] == [urgent_work.request_ids]
    assert batch_row(sessions, batch.id).status == "in_progress"


def test_fifty_thousand_lines_in_one_transaction(sessions, engine):
    lines = jsonl([chat(f"req-{i}", f"document {i}", max_tokens=16) for i in range(store.MAX_LINES)])
    start = time.perf_counter()
    batch, work = submit(sessions, lines)
    elapsed = time.perf_counter() - start
    print(f"\n{engine.dialect.name}: {store.MAX_LINES} lines ({len(lines) / 1e6:.1f} MB) -> batch in {elapsed:.2f} s")
    assert (batch.request_total, len(work.request_ids)) == (store.MAX_LINES, store.MAX_LINES)
    assert counts(sessions, batch.id) == (store.MAX_LINES, 0)
