"""The worker's side: claims are exclusive, results are stored exactly once whatever is delivered twice or raced,
and the write that finishes the last request completes the batch exactly once."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from sqlalchemy import event, func, select, text
from store_test_utils import batch_row, chat, failed, ok, statuses, submit

from sluice.api import store
from sluice.api.tables import Request, Result, WebhookDelivery


def run_together(*calls):
    """Run the calls in threads released at the same moment; returns their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list = []

    def run(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def claim(sessions, ids, worker, lease=60.0):
    with sessions.begin() as session:
        return store.claim(session, ids, worker, lease)


def write(sessions, results, worker):
    with sessions.begin() as session:
        return store.write_results(session, results, worker)


def endpoint(sessions, events=None):
    with sessions.begin() as session:
        store.create_webhook_endpoint(session, store.get_or_create_tenant(session, "acme").id,
                                      "https://example.com/hook", events)


def test_claim_returns_what_the_engine_needs_and_skips_the_rest(sessions):
    batch, work = submit(sessions, [chat("a", max_tokens=4), chat("b"), chat("c")], priority=1)
    a, b, c = work.request_ids
    assert [r.id for r in claim(sessions, [a], "w1")] == [a]
    write(sessions, [ok(a)], "w1")
    claimed = claim(sessions, [a, b, c, 999], "w2")
    assert [r.id for r in claimed] == [b, c]
    first = claimed[0]
    assert (first.batch_id, first.custom_id, first.line, first.model, first.priority, first.attempts) == (
        batch.id, "b", 2, "tiny", 1, 1)
    assert first.body["messages"] == [{"role": "user", "content": "Hello"}]
    assert claim(sessions, [b, c], "w3") == []  # held under live leases


def test_claim_is_exclusive_under_concurrency(sessions):
    _, work = submit(sessions, [chat(str(i)) for i in range(200)])
    ids = work.request_ids
    for round_ids in (ids[:100], ids[100:]):
        got = run_together(*(partial(claim, sessions, round_ids, w) for w in ("w1", "w2", "w3")))
        claimed = [r.id for rows in got for r in rows]
        assert sorted(claimed) == round_ids  # each id claimed once, by one worker
    with sessions.begin() as session:
        assert session.scalar(select(func.max(Request.attempts))) == 1


def test_an_expired_lease_is_taken_over(sessions):
    _, work = submit(sessions, [chat("a")])
    claim(sessions, work.request_ids, "dead", lease=-1)
    taken = claim(sessions, work.request_ids, "alive")
    assert [(r.id, r.attempts) for r in taken] == [(work.request_ids[0], 2)]
    # the dead worker's late result is refused: the request is held by a live lease now
    assert write(sessions, [ok(work.request_ids[0])], "dead") == []
    assert write(sessions, [ok(work.request_ids[0])], "alive") == work.request_ids


def test_a_request_that_stopped_max_attempts_workers_is_not_claimed_again(sessions):
    from sluice.api.store.recovery import MAX_ATTEMPTS

    _, work = submit(sessions, [chat("poison")])
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert [r.attempts for r in claim(sessions, work.request_ids, f"victim-{attempt}", lease=-1)] == [attempt]
    # a late message must not have it kill a fourth worker: the reconciler fails it instead
    assert claim(sessions, work.request_ids, "next") == []


def test_writing_the_same_results_twice_changes_nothing(sessions):
    endpoint(sessions)
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c", max_tokens=0)])
    a, b = work.request_ids
    claim(sessions, [a, b], "w1")
    assert write(sessions, [ok(a), failed(b, 2)], "w1") == [a, b]
    before = batch_row(sessions, batch.id)
    assert write(sessions, [ok(a, text="again"), ok(b)], "w1") == []
    after = batch_row(sessions, batch.id)
    assert (after.request_completed, after.request_failed, after.status) == (1, 2, "completed")
    assert (before.request_completed, before.request_failed) == (1, 2)
    with sessions.begin() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == 3
        assert session.get(Result, a).response["choices"][0]["message"]["content"] == "hi"
        assert session.scalar(select(func.count()).select_from(WebhookDelivery)) == 1


def test_concurrent_last_writes_finalize_exactly_once(sessions):
    endpoint(sessions, ["batch.completed"])
    for _ in range(8):
        batch, work = submit(sessions, [chat(str(i)) for i in range(6)])
        ids = work.request_ids
        claim(sessions, ids[:3], "w1")
        claim(sessions, ids[3:], "w2")
        # the same chunk delivered twice races too
        run_together(partial(write, sessions, [ok(i) for i in ids[:3]], "w1"),
                     partial(write, sessions, [ok(i) for i in ids[3:]], "w2"),
                     partial(write, sessions, [ok(i) for i in ids[3:]], "w2"))
        done = batch_row(sessions, batch.id)
        assert (done.status, done.request_completed, done.request_failed) == ("completed", 6, 0)
        assert done.finalizing_at == done.completed_at is not None
        with sessions.begin() as session:
            events = session.scalars(select(WebhookDelivery.payload)).all()
            session.execute(WebhookDelivery.__table__.delete())
        assert [(e["type"], e["data"]["id"]) for e in events] == [("batch.completed", batch.id)]


ODD_TEXT = 'tab\tnewline\ncr\r backslash \\ \\N \\. quote" \u00e9\u4e2d \U0001f600 end'


def test_bulk_writes_keep_every_character_and_float(sessions):
    """Request rows and results are written by COPY on PostgreSQL, whose text format escapes tabs, newlines,
    backslashes and its NULL marker: what is read back must be what was written, to the last bit of a float."""
    batch, work = submit(sessions, [chat("a\tb\\N", content=ODD_TEXT), chat("nothing", content="")])
    (a, b), (first, second) = work.request_ids, claim(sessions, work.request_ids, "w1")
    assert (first.custom_id, first.body["messages"][0]["content"]) == ("a\tb\\N", ODD_TEXT)
    assert second.body["messages"][0]["content"] == ""
    third = 1 / 3
    write(sessions, [ok(a, text=ODD_TEXT, gpu_seconds=third), failed(b, 2)], "w1")
    with sessions.begin() as session:
        result, error = session.get(Result, a), session.get(Result, b)
        assert result.response["choices"][0]["message"]["content"] == ODD_TEXT
        assert (result.gpu_seconds, result.error, error.response) == (third, None, None)
        assert error.error["param"] == "body.messages"
        assert session.scalars(select(Result.request_id).where(Result.response.is_(None))).all() == [b]  # SQL NULL
        output = list(store.output_lines(session, batch.id))
    assert output[0]["custom_id"] == "a\tb\\N"
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == ODD_TEXT


def test_a_chunks_ids_are_one_parameter_whatever_their_number(engine, sessions):
    """Claims of 0, 1, 3 and 40 ids (with unknown and repeated ones) run one SQL text: the ids are bound as one list,
    not rendered into the statement per execution."""
    _, work = submit(sessions, [chat(str(i)) for i in range(45)])
    ids, texts = work.request_ids, set()

    def seen(connection, cursor, statement, parameters, context, executemany):
        if statement.startswith("UPDATE requests"):
            texts.add(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        assert claim(sessions, [], "w1") == []
        assert [r.id for r in claim(sessions, [ids[0]], "w1")] == [ids[0]]
        assert [r.id for r in claim(sessions, [ids[1], ids[1], 10**9, ids[2]], "w1")] == ids[1:3]
        assert [r.id for r in claim(sessions, ids[:43], "w1")] == ids[3:43]
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert len(texts) == 1


def test_results_of_queued_requests_are_accepted(sessions):
    # e.g. a worker that refuses a request before claiming it
    batch, work = submit(sessions, [chat("a")])
    assert write(sessions, [failed(work.request_ids[0], 1)], "w1") == work.request_ids
    assert batch_row(sessions, batch.id).status == "completed"


def test_release_requeues_and_renew_reports_what_was_lost(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c")])
    a, b, c = work.request_ids
    claim(sessions, [a, b], "w1", lease=-1)
    claim(sessions, [b], "w2")  # took b over after w1's lease ran out
    with sessions.begin() as session:
        assert store.renew_leases(session, [a, b], "w1", 60) == [b]
        assert store.release(session, [a, b, c], "w1") == [a]
    assert statuses(sessions, batch.id) == {a: "queued", b: "running", c: "queued"}


def test_result_must_have_a_response_or_an_error():
    with pytest.raises(ValueError, match="not both or neither"):
        store.RequestResult(1)
    with pytest.raises(ValueError, match="200 means a response"):
        store.RequestResult(1, error={"code": "x", "message": "m", "param": None})


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_chunks_statements_read_its_requests_by_primary_key_even_without_statistics(engine, sessions):
    """Just after a big batch is inserted PostgreSQL has no statistics on it yet. The claim, renew and finish of a
    chunk must still read their rows through the primary key: with the status and batch indexes instead, every
    chunk read the index entries of every queued request of its batch."""
    _, work = submit(sessions, [chat(f"r{i}") for i in range(5000)])
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM pg_statistic WHERE starelid IN ('requests'::regclass, "
                                "'batches'::regclass)"))
    ids = work.request_ids[2000:2032]
    plans = []

    def explain(connection, cursor, statement, parameters, context, executemany):
        if statement.startswith("UPDATE requests"):
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))

    event.listen(engine, "before_cursor_execute", explain)
    try:
        claim(sessions, ids, "w1")
        with sessions.begin() as session:
            assert store.renew_leases(session, ids, "w1", 60.0) == []
        assert write(sessions, [ok(i) for i in ids], "w1") == ids
    finally:
        event.remove(engine, "before_cursor_execute", explain)
    assert len(plans) == 3
    for plan in plans:
        assert "pk_requests" in plan and "ix_requests" not in plan and "uq_requests" not in plan, plan
