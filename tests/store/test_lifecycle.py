"""Cancel, expiry and recovery: every batch reaches its end state exactly once, whoever races to it."""

from __future__ import annotations

import re
import time
from functools import partial

import psycopg
import pytest
from sqlalchemy import event, select, text, update
from store_test_utils import batch_row, chat, ok, statuses, submit
from test_leases import claim, endpoint, run_together, write

from sluice.api import store
from sluice.api.tables import Batch, Request, Result, WebhookDelivery


def events(sessions) -> list[str]:
    with sessions.begin() as session:
        return session.scalars(select(WebhookDelivery.event_type).order_by(WebhookDelivery.created_at)).all()


def cancel(sessions, batch_id):
    with sessions.begin() as session:
        return store.cancel_batch(session, batch_id).status


def test_cancel_drops_queued_waits_for_running_and_keeps_finished(sessions):
    endpoint(sessions)
    batch, work = submit(sessions, [chat("done"), chat("running"), chat("queued"), chat("bad", max_tokens=0)])
    done, running, queued = work.request_ids
    claim(sessions, [done, running], "w1")
    write(sessions, [ok(done)], "w1")
    assert cancel(sessions, batch.id) == "cancelling"
    assert statuses(sessions, batch.id)[queued] == "cancelled"
    assert claim(sessions, [queued, running], "w2") == []  # nothing more starts
    with sessions.begin() as session:
        # the worker learns its request is doomed, aborts it and says so; that ends the batch
        assert store.renew_leases(session, [running], "w1", 60) == [running]
        assert store.mark_cancelled(session, [running], "w1") == [running]
    ended = batch_row(sessions, batch.id)
    assert (ended.status, ended.request_total, ended.request_completed, ended.request_failed) == (
        "cancelled", 4, 1, 1)
    assert ended.cancelling_at <= ended.cancelled_at
    assert list(statuses(sessions, batch.id).values()) == ["completed", "cancelled", "cancelled", "failed"]
    assert events(sessions) == ["batch.cancelled"]
    assert cancel(sessions, batch.id) == "cancelled"  # again: no change, no second event
    assert events(sessions) == ["batch.cancelled"]


def test_a_running_request_finishing_during_cancel_is_kept(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b")])
    claim(sessions, work.request_ids, "w1")
    cancel(sessions, batch.id)
    assert write(sessions, [ok(work.request_ids[0])], "w1") == [work.request_ids[0]]
    assert batch_row(sessions, batch.id).status == "cancelling"
    with sessions.begin() as session:
        assert store.release(session, [work.request_ids[1]], "w1") == [work.request_ids[1]]
    ended = batch_row(sessions, batch.id)
    assert (ended.status, ended.request_completed) == ("cancelled", 1)


def test_concurrent_aborts_of_the_last_running_requests_end_the_cancel(sessions):
    for _ in range(6):
        batch, work = submit(sessions, [chat("a"), chat("b")])
        a, b = work.request_ids
        claim(sessions, [a], "w1")
        claim(sessions, [b], "w2")
        cancel(sessions, batch.id)
        assert run_together(partial(abort, sessions, [a], "w1"), partial(abort, sessions, [b], "w2")) == [[a], [b]]
        assert batch_row(sessions, batch.id).status == "cancelled"


def abort(sessions, ids, worker):
    with sessions.begin() as session:
        return store.mark_cancelled(session, ids, worker)


def test_only_running_batches_can_be_cancelled(sessions):
    batch, work = submit(sessions, [chat("a")])
    write(sessions, [ok(work.request_ids[0])], "w1")
    with sessions.begin() as session:
        with pytest.raises(store.InvalidInput, match="is completed"):
            store.cancel_batch(session, batch.id)
        with pytest.raises(store.NotFound):
            store.cancel_batch(session, "batch_nope")
        other = store.get_or_create_tenant(session, "other")
        with pytest.raises(store.NotFound):
            store.cancel_batch(session, batch.id, tenant_id=other.id)


def expire_now(sessions, batch_id):
    with sessions.begin() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=0))
        return store.expire_batches(session)


def test_expiry_fails_unfinished_requests_and_ignores_late_results(sessions):
    endpoint(sessions)
    batch, work = submit(sessions, [chat("done"), chat("running"), chat("queued"), chat("bad", max_tokens=0)])
    done, running, queued = work.request_ids
    claim(sessions, [done, running], "w1")
    write(sessions, [ok(done)], "w1")
    later, _ = submit(sessions, [chat("x")])  # not yet due
    assert expire_now(sessions, batch.id) == [batch.id]
    assert write(sessions, [ok(running)], "w1") == []  # the late result changes nothing
    with sessions.begin() as session:
        assert store.renew_leases(session, [running], "w1", 60) == [running]  # abort it
        errors = {r.request_id: r.error for r in session.scalars(select(Result).where(
            Result.request_id.in_([running, queued])))}
    assert errors[running] == {"code": "batch_expired", "param": None,
                               "message": "line 2: this request could not be executed before the completion window "
                                          "expired"}
    ended = batch_row(sessions, batch.id)
    assert (ended.status, ended.request_completed, ended.request_failed, ended.expired_at is not None) == (
        "expired", 1, 3, True)
    assert statuses(sessions, batch.id)[queued] == "expired"
    assert batch_row(sessions, later.id).status == "in_progress"
    assert events(sessions) == ["batch.expired"]
    assert expire_now(sessions, batch.id) == []


def claim_and_die(sessions, ids, worker):
    claimed = claim(sessions, ids, worker, lease=0.05)
    time.sleep(0.1)
    return claimed


def test_reconcile_republishes_a_dead_workers_requests_once(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c")], priority=7)
    a, b, c = work.request_ids
    claim(sessions, [c], "alive")
    claim_and_die(sessions, [a, b], "dead")
    with sessions.begin() as session:
        assert store.recover_expired_leases(session) == [store.Work("tiny", 7, [a, b])]
    with sessions.begin() as session:
        assert store.recover_expired_leases(session) == []  # a message went out since the lease ran out
    assert [r.id for r in claim_and_die(sessions, [a, b], "new")] == [a, b]
    with sessions.begin() as session:  # ... and the new worker died too
        assert store.recover_expired_leases(session) == [store.Work("tiny", 7, [a, b])]


def test_a_request_that_keeps_killing_workers_fails_after_max_attempts(sessions):
    from sluice.api.store.recovery import MAX_ATTEMPTS

    batch, work = submit(sessions, [chat("poison"), chat("fine")])
    poison, fine = work.request_ids
    for attempt in range(1, MAX_ATTEMPTS + 1):
        claim_and_die(sessions, [poison], f"victim-{attempt}")
        with sessions.begin() as session:
            work_again = store.recover_expired_leases(session)
        assert work_again == ([store.Work("tiny", 5, [poison])] if attempt < MAX_ATTEMPTS else [])
    assert statuses(sessions, batch.id) == {poison: "failed", fine: "queued"}
    row = batch_row(sessions, batch.id)
    assert (row.status, row.request_completed, row.request_failed) == ("in_progress", 0, 1)
    with sessions.begin() as session:
        errors = list(store.error_lines(session, batch.id))
    assert errors[0]["custom_id"] == "poison" and errors[0]["error"]["code"] == "worker_lost"
    assert f"stopped {MAX_ATTEMPTS} times" in errors[0]["error"]["message"]


def test_restarts_that_gave_a_request_back_are_not_counted_as_attempts(sessions):
    from sluice.api.store.recovery import MAX_ATTEMPTS

    batch, work = submit(sessions, [chat("a")])
    for restart in range(MAX_ATTEMPTS + 1):  # rolling restarts: each worker gave it back at its SIGTERM
        assert [r.attempts for r in claim(sessions, work.request_ids, f"restarted-{restart}")] == [1]
        with sessions.begin() as session:
            assert store.release(session, work.request_ids, f"restarted-{restart}") == work.request_ids
    claim_and_die(sessions, work.request_ids, "crashed")  # then one real crash
    with sessions.begin() as session:
        assert store.recover_expired_leases(session) == [store.Work("tiny", 5, work.request_ids)]
    assert statuses(sessions, batch.id) == {work.request_ids[0]: "running"}


def test_a_recovered_request_whose_message_is_lost_too_is_sent_again(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b")])
    a, b = work.request_ids
    claim(sessions, [b], "alive")
    claim_and_die(sessions, [a], "dead")
    with sessions.begin() as session:
        assert store.recover_expired_leases(session) == [store.Work("tiny", 5, [a])]
    # that message is lost too (Redis flushed): a still waits for a worker, and goes again once its message is stale
    with sessions.begin() as session:
        assert store.models_with_waiting_requests(session) == ["tiny"]
        assert store.republish_stale(session, older_than=60) == []
        session.execute(update(Request).values(published_at=Request.published_at - 120))
    with sessions.begin() as session:
        assert store.republish_stale(session, older_than=60) == [store.Work("tiny", 5, [a])]
        assert store.republish_stale(session, older_than=60) == []


def test_reconcile_republishes_requests_queued_too_long(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b")])
    a, b = work.request_ids
    claim(sessions, [b], "w1")
    with sessions.begin() as session:
        assert store.republish_stale(session, older_than=60) == []
        session.execute(update(Request).values(published_at=Request.published_at - 120))
    with sessions.begin() as session:
        assert store.republish_stale(session, older_than=60) == [store.Work("tiny", 5, [a])]
        assert store.republish_stale(session, older_than=60) == []
    cancel(sessions, batch.id)
    with sessions.begin() as session:
        session.execute(update(Request).values(published_at=0))
        assert store.republish_stale(session, older_than=60) == []  # nothing of a cancelled batch runs again


def test_reconcile_ends_a_cancel_whose_worker_died(sessions):
    batch, work = submit(sessions, [chat("a")])
    claim_and_die(sessions, work.request_ids, "dead")
    with sessions.begin() as session:
        session.execute(update(Batch).values(status="cancelling"))  # cancelled while the lease still ran
        assert store.recover_expired_leases(session) == []
    assert batch_row(sessions, batch.id).status == "cancelled"


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_the_reconciler_and_the_gauges_read_only_the_requests_in_flight_even_under_generic_plans(engine, sessions):
    """Their lookups go through the partial indexes over running and queued requests, not over every request ever
    run, also in the generic plan PostgreSQL gives a statement prepared and run often (psycopg prepares it at its
    sixth run): a status passed as a bound parameter would hide which partial index applies there."""
    _, work = submit(sessions, [chat(f"r{i}") for i in range(20_000)])
    ids = work.request_ids
    claim(sessions, ids[-200:-100], "w1", lease=-1)  # running under a lease that ran out
    with engine.begin() as connection:  # the rest finished, the last 100 still queued
        connection.execute(update(Request).where(Request.id < ids[-200]).values(status="completed"))
        # published an hour ago: before the leases ran out, however fast the lines above were stored
        connection.execute(update(Request).values(published_at=Request.published_at - 3600))
        connection.execute(text("ANALYZE requests; ANALYZE batches"))
    plans = []

    def generic_plan(connection, cursor, statement, parameters, context, executemany):
        if "FROM requests" not in statement and not statement.startswith("UPDATE requests"):
            return
        names = re.findall(r"%\((\w+)\)s", statement)
        numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}", statement)
        raw = connection.connection.driver_connection
        raw.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        raw.execute(f"PREPARE generic AS {numbered}")
        args = ", ".join(["%s"] * len(dict.fromkeys(names)))
        rows = psycopg.ClientCursor(raw).execute(f"EXPLAIN EXECUTE generic({args})",
                                                 [parameters[n] for n in dict.fromkeys(names)]).fetchall()
        raw.execute("DEALLOCATE generic")
        plans.append("\n".join(row[0] for row in rows))

    event.listen(engine, "before_cursor_execute", generic_plan)
    try:
        with sessions.begin() as session:
            assert store.requests_by_status(session, ("queued", "running")) == {("tiny", "queued"): 100,
                                                                               ("tiny", "running"): 100}
            assert store.models_with_waiting_requests(session) == ["tiny"]
            assert [w.request_ids for w in store.recover_expired_leases(session)] == [ids[-200:-100]]
            assert [w.request_ids for w in store.republish_stale(session, -10)] == [ids[-200:]]
    finally:
        event.remove(engine, "before_cursor_execute", generic_plan)
    assert len(plans) >= 4
    for plan in plans:
        assert "Seq Scan on requests" not in plan, plan
        assert "ix_requests_running_lease" in plan, plan  # each of them reads running requests
