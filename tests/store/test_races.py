"""Races between API hosts, workers and reconcilers sharing one PostgreSQL database, each interleaving forced: a
transaction is held open until another connection waits for its row locks, then let go.

PostgreSQL only: on SQLite every transaction starts with BEGIN IMMEDIATE, so none of them interleave."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text, update
from store_test_utils import batch_row, chat, ok, statuses, submit

from sluice.api import store
from sluice.api.store.recovery import MAX_ATTEMPTS
from sluice.api.tables import Request, WebhookDelivery

pytestmark = pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
WAITING = text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")


class InThread:
    """A transaction run on a thread of its own; join() returns its result or raises its error."""

    def __init__(self, sessions, work):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(sessions, work))
        self.thread.start()

    def _run(self, sessions, work):
        try:
            with sessions.begin() as session:
                self.result = work(session)
        except Exception as e:  # raised by join(), in the test's thread
            self.error = e

    def join(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def waiting(engine, count: int = 1) -> None:
    """Return once `count` connections wait for a lock that another transaction holds."""
    deadline = time.monotonic() + 30
    with engine.connect() as connection:
        while connection.scalar(WAITING) < count:
            assert time.monotonic() < deadline, f"fewer than {count} transactions came to wait for a lock"
            connection.rollback()
            time.sleep(0.01)


def test_a_reconciler_whose_exhausted_request_finished_while_it_waited_for_the_batch(engine, sessions):
    """The reconciler picks a batch for a request that stopped MAX_ATTEMPTS workers, but the slow last worker writes
    its result first: the pass goes on (it failed on an empty INSERT of worker_lost results, expiries and all)."""
    batch, work = submit(sessions, [chat("slow"), chat("queued")])
    slow = work.request_ids[0]
    with sessions.begin() as session:
        store.claim(session, [slow], "slow", 60)
        session.execute(update(Request).where(Request.id == slow)
                        .values(attempts=MAX_ATTEMPTS, lease_expires_at=time.time() - 1))
    with sessions() as writer, writer.begin():
        assert store.write_results(writer, [ok(slow)], "slow") == [slow]
        reconciler = InThread(sessions, store.recover_expired_leases)
        waiting(engine)
    assert reconciler.join() == []
    row = batch_row(sessions, batch.id)
    assert (row.request_completed, row.request_failed, statuses(sessions, batch.id)[slow]) == (1, 0, "completed")


def test_a_cancel_and_a_claim_of_rows_moved_by_updates_do_not_deadlock(engine, sessions):
    """A chunk sent again (its first worker died) is claimed while the batch is cancelled: the claim locks rows by id,
    the cancel's UPDATE in the order it scans them, and the rows of the dead worker's requests moved when they were
    claimed. The cancel took the first queued row, the claim the moved ones: each waited for the other, and the
    cancel was chosen as the deadlock's victim (a 500 from the API)."""
    batch, work = submit(sessions, [chat(str(i)) for i in range(1000)])  # the cancel scans the whole table
    a, b, c = work.request_ids[:3]
    with sessions.begin() as session:
        store.claim(session, [a, b], "dead", 60)
        session.execute(update(Request).where(Request.id.in_([a, b])).values(lease_expires_at=time.time() - 1))
        session.execute(text("ANALYZE requests"))
        assert session.scalars(select(Request.id).where(Request.id.in_([a, b, c]))
                               .order_by(text("ctid"))).all() == [c, a, b]
    with sessions() as other, other.begin():  # the same requests, sent twice, are being claimed by another worker
        assert [r.id for r in store.claim(other, [b], "w2", 60)] == [b]
        claim = InThread(sessions, lambda s: [r.id for r in store.claim(s, [a, b, c], "w1", 60)])
        waiting(engine)  # holds a, waits for b
        cancel = InThread(sessions, lambda s: store.cancel_batch(s, batch.id).status)
        waiting(engine, 2)
    assert claim.join() == [a, c]
    assert cancel.join() == "cancelling"
    assert [statuses(sessions, batch.id)[i] for i in (a, b, c)] == ["running"] * 3


def test_a_webhook_endpoint_deleted_while_the_last_result_is_written(engine, sessions):
    """notify read the endpoint the tenant was deleting, and its outbox row then failed the foreign key: the worker's
    whole result write (or the API's cancel, or the reconciler's expiry) failed with it."""
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        hook = store.create_webhook_endpoint(session, tenant.id, "https://example.com/hook")
    batch, work = submit(sessions, [chat("a")])
    with sessions.begin() as session:
        store.claim(session, work.request_ids, "w1", 60)
    with sessions() as deleter, deleter.begin():
        store.delete_webhook_endpoint(deleter, hook.id, tenant.id)
        deleter.flush()
        writer = InThread(sessions, lambda s: store.write_results(s, [ok(work.request_ids[0])], "w1"))
        waiting(engine)
    assert writer.join() == work.request_ids
    assert batch_row(sessions, batch.id).status == "completed"
    with sessions.begin() as session:
        assert session.scalars(select(WebhookDelivery)).all() == []


def test_two_deletes_of_one_file_at_once_are_one_delete_and_one_not_found(engine, sessions):
    """Both answered deleted: true; one after the other, the second is a 404."""
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        file = store.store_file(session, tenant.id, "in.jsonl", "batch", b"{}\n")
    with sessions() as first, first.begin():
        store.delete_file(first, file.id, tenant.id)
        first.flush()
        second = InThread(sessions, lambda s: store.delete_file(s, file.id, tenant.id))
        waiting(engine)
    with pytest.raises(store.NotFound, match=f"file {file.id} not found"):
        second.join()
