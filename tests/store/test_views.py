"""What users read back: the Batch object, output and error lines (ordered, partial while running, the format of
`sluice run`), usage and cost sums, and the usage by tenant and day."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from sqlalchemy import event, select, text, update
from store_test_utils import chat, failed, ok, submit
from test_leases import claim, write

from sluice.api import store
from sluice.api.store.workers import LIVE_SECONDS
from sluice.api.tables import EfficiencyWindow, Request, Result, Worker


def view(sessions, batch_id):
    with sessions.begin() as session:
        return store.batch_view(session, store.get_batch(session, batch_id))


def lines(sessions, batch_id):
    with sessions.begin() as session:
        return list(store.output_lines(session, batch_id)), list(store.error_lines(session, batch_id))


def test_output_and_error_lines_are_ordered_and_partial_while_running(sessions):
    batch, work = submit(sessions, [chat("a"), chat("b"), "{oops", chat("c"), chat("d")])
    a, b, c, d = work.request_ids
    claim(sessions, work.request_ids, "w1")
    write(sessions, [ok(c, text="C"), failed(b, 2)], "w1")
    outputs, errors = lines(sessions, batch.id)
    assert [(o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"]) for o in outputs] == [
        ("c", "C")]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("b", "invalid_prompt", 2), (None, "invalid_json_line", 3)]
    write(sessions, [ok(d, text="D"), ok(a, text="A")], "w1")
    outputs, errors = lines(sessions, batch.id)
    assert [o["custom_id"] for o in outputs] == ["a", "c", "d"]
    # the line format of `sluice run`
    first = outputs[0]
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert first["id"].startswith("batch_req_") and first["response"]["status_code"] == 200
    assert errors[0] == {"id": errors[0]["id"], "custom_id": "b", "response": None,
                         "error": {"code": "invalid_prompt", "message": "line 2: refused", "param": "body.messages",
                                   "line": 2}}
    # every download names the lines the same, and no two lines alike
    again_outputs, again_errors = lines(sessions, batch.id)
    ids = [(x["id"], x.get("response") and x["response"]["request_id"]) for x in outputs + errors]
    assert ids == [(x["id"], x.get("response") and x["response"]["request_id"]) for x in again_outputs + again_errors]
    assert len({i for i, _ in ids}) == len(ids)


def test_batch_view_has_openai_fields_usage_and_cost(sessions, monkeypatch):
    monkeypatch.setenv("SLUICE_GPU_HOUR_COST", "3.6")  # a thousandth per GPU-second
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c", max_tokens=0)], metadata={"run": "7"})
    a, b = work.request_ids
    claim(sessions, [a, b], "w1")
    write(sessions, [ok(a, prompt_tokens=10, cached_tokens=4, completion_tokens=6, gpu_seconds=2.0)], "w1")
    running = view(sessions, batch.id)
    assert running["status"] == "in_progress" and running["completed_at"] is None
    assert (running["output_file_id"], running["error_file_id"]) == (store.output_file_id(batch.id),
                                                                      store.error_file_id(batch.id))
    write(sessions, [ok(b, prompt_tokens=20, cached_tokens=0, completion_tokens=3, gpu_seconds=1.0)], "w1")
    done = view(sessions, batch.id)
    assert {k for k, v in done.items() if v is None} == {"errors", "failed_at", "expired_at", "cancelling_at",
                                                         "cancelled_at"}
    assert (done["object"], done["status"], done["endpoint"], done["model"], done["completion_window"]) == (
        "batch", "completed", "/v1/chat/completions", "tiny", "24h")
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert done["metadata"] == {"run": "7"}
    assert done["expires_at"] - done["created_at"] == 24 * 3600
    assert all(isinstance(done[k], int) for k in ("created_at", "in_progress_at", "finalizing_at", "completed_at"))
    assert done["usage"] == {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 9,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 39,
                             "gpu_seconds": 3.0, "cost": pytest.approx(0.003)}
    assert store.view_file(done["output_file_id"]) == ("output", batch.id)
    assert store.view_file(done["error_file_id"]) == ("error", batch.id)
    assert store.view_file(batch.input_file_id) is None


def test_waiting_for_worker_until_a_live_worker_serves_the_model(sessions):
    batch, _ = submit(sessions, [chat("a")])
    assert view(sessions, batch.id)["waiting_for_worker"] is True
    with sessions.begin() as session:
        store.heartbeat(session, "host:1", hostname="host", pid=1, model="/models/x", served_model_name="other")
    assert view(sessions, batch.id)["waiting_for_worker"] is True
    with sessions.begin() as session:
        store.heartbeat(session, "host:2", hostname="host", pid=2, model="/models/tiny", served_model_name="tiny")
    assert view(sessions, batch.id)["waiting_for_worker"] is False
    with sessions.begin() as session:
        store.heartbeat(session, "host:2", hostname="host", pid=2, model="/models/tiny", served_model_name="tiny",
                        status="stopped")
        assert [w.id for w in store.live_workers(session)] == ["host:1"]
    assert view(sessions, batch.id)["waiting_for_worker"] is True


def test_heartbeats_keep_the_start_and_go_stale(sessions):
    with sessions.begin() as session:
        store.heartbeat(session, "w", hostname="h", pid=3, model="/m", served_model_name="tiny")
    with sessions.begin() as session:
        first = store.live_workers(session, "tiny")[0]
        started, beat = first.started_at, first.last_heartbeat_at
    time.sleep(0.01)
    with sessions.begin() as session:
        store.heartbeat(session, "w", hostname="h", pid=3, model="/m", served_model_name="tiny")
    with sessions.begin() as session:
        again = session.get(Worker, "w")
        assert (again.started_at, again.last_heartbeat_at > beat) == (started, True)
        again.last_heartbeat_at -= LIVE_SECONDS + 1
    with sessions.begin() as session:
        assert store.live_workers(session, "tiny") == []
        with pytest.raises(ValueError, match="status"):
            store.heartbeat(session, "w", hostname="h", pid=3, model="/m", served_model_name="tiny", status="dead")


def test_efficiency_windows_of_a_model_over_a_time_range(sessions):
    with sessions.begin() as session:
        store.heartbeat(session, "w", hostname="h", pid=3, model="/m", served_model_name="tiny")
        for start in (0, 10, 20):
            store.record_efficiency(session, EfficiencyWindow(
                worker_id="w", model="tiny", window_start=start, window_end=start + 10, steps=5, prefill_tokens=100,
                decode_tokens=40, mean_running_seqs=3.5, max_running_seqs=4, max_num_seqs=8, token_budget_use=0.4,
                kv_cache_use=0.2, preemptions=0, prefix_cache_queries=100, prefix_cache_hits=25, busy_seconds=9.0,
                idle_seconds=1.0))
    with sessions.begin() as session:
        assert [w.window_start for w in store.efficiency_windows(session, "tiny", 12, 25)] == [10, 20]
        assert store.efficiency_windows(session, "other", 0, 30) == []


def test_tenant_usage_by_day_and_batch(sessions, monkeypatch):
    monkeypatch.setenv("SLUICE_GPU_HOUR_COST", "7.2")
    first, w1 = submit(sessions, [chat("a"), chat("b")])
    second, w2 = submit(sessions, [chat("c")])
    submit(sessions, [chat("x")], tenant="someone-else")
    write(sessions, [ok(i, gpu_seconds=1.0) for i in w1.request_ids + w2.request_ids], "w1")
    day = 86_400
    with sessions.begin() as session:  # move one result to the previous UTC day
        session.execute(update(Result).where(Result.request_id == w1.request_ids[0])
                        .values(finished_at=Result.finished_at - day))
        tenant = store.get_or_create_tenant(session, "acme")
        usage = store.tenant_usage(session, tenant.id, 0, time.time() + 1)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    yesterday = time.strftime("%Y-%m-%d", time.gmtime(time.time() - day))
    assert sorted((u.day, u.batch_id, u.requests, u.prompt_tokens, u.completion_tokens) for u in usage) == sorted([
        (yesterday, first.id, 1, 5, 3), (today, first.id, 1, 5, 3), (today, second.id, 1, 5, 3)])
    assert all(u.gpu_seconds == 1.0 and u.cost == pytest.approx(0.002) for u in usage)


@pytest.mark.parametrize("price", ["-1", "abc", "nan", "inf"])
def test_a_bad_gpu_hour_price_is_named(monkeypatch, price):
    monkeypatch.setenv("SLUICE_GPU_HOUR_COST", price)
    with pytest.raises(ValueError, match="SLUICE_GPU_HOUR_COST"):
        store.cost(1.0)


def test_batch_not_found_for_another_tenant(sessions):
    batch, _ = submit(sessions, [chat("a")])
    with sessions.begin() as session:
        other = store.get_or_create_tenant(session, "other")
        with pytest.raises(store.NotFound, match=batch.id):
            store.get_batch(session, batch.id, tenant_id=other.id)
        assert store.get_batch(session, batch.id, tenant_id=batch.tenant_id).id == batch.id


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_result_page_reads_its_batchs_results_not_every_batchs_before_them(engine, sessions):
    """Ordered by the indexed results.finished_at, PostgreSQL could walk that index from every batch's first result,
    betting that the page's rows come early; a new batch's come last, so on a large table its first page read all the
    history (1M results: 1 s). A planner that would rather not sort, as on such a table, stands in for its size."""
    _, old = submit(sessions, [chat(f"o{i}") for i in range(3000)])
    batch, new = submit(sessions, [chat(f"n{i}") for i in range(300)])
    for ids in (old.request_ids, new.request_ids):
        claim(sessions, ids, "w1")
        write(sessions, [ok(i) for i in ids], "w1")
    with engine.begin() as connection:
        connection.execute(text("ANALYZE"))
    with explained(engine) as plans:
        with sessions.begin() as session:
            session.execute(text("SET LOCAL enable_sort = off"))
            page, more = store.result_page(session, batch.id, None, 100)
    assert len(page) == 100 and more and {r["custom_id"] for r in page} <= {f"n{i}" for i in range(300)}
    assert len(plans) == 1 and "ix_results_finished_at" not in plans[0], plans


@contextmanager
def explained(engine):
    """The plans PostgreSQL makes for the ordered queries run inside the block (EXPLAIN of each as it runs)."""
    plans = []

    def explain(connection, cursor, statement, parameters, context, executemany):
        if "ORDER BY" in statement:
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))

    event.listen(engine, "before_cursor_execute", explain)
    try:
        yield plans
    finally:
        event.remove(engine, "before_cursor_execute", explain)


def test_a_batchs_usage_is_the_sum_of_its_results_whatever_writes_it_again(sessions):
    """The batch keeps its usage sums as results are written: each equals the SQL sum over its results (a second
    write of the same requests, with other numbers, changes neither), and one write's two batches sum apart."""
    one, work_one = submit(sessions, [chat("a"), chat("b"), chat("bad", max_tokens=0)])
    two, work_two = submit(sessions, [chat("c")])
    a, b = work_one.request_ids
    (c,) = work_two.request_ids
    claim(sessions, [a, b, c], "w1")
    write(sessions, [ok(a, prompt_tokens=10, cached_tokens=4, completion_tokens=6, gpu_seconds=2.0),
                     ok(c, prompt_tokens=7, completion_tokens=1, gpu_seconds=0.5)], "w1")
    write(sessions, [ok(a, prompt_tokens=99, completion_tokens=99, gpu_seconds=9.0), failed(b, 2)], "w1")
    for batch_id in (one.id, two.id):
        with sessions.begin() as session:
            sums = session.execute(text(
                "SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
                "COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(results.gpu_seconds), 0) FROM results JOIN "
                "requests ON requests.id = results.request_id WHERE requests.batch_id = :b"), {"b": batch_id}).one()
        usage = view(sessions, batch_id)["usage"]
        assert (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"],
                usage["gpu_seconds"]) == tuple(sums)
    assert [view(sessions, batch_id)["usage"]["input_tokens"] for batch_id in (one.id, two.id)] == [10, 7]


def test_every_result_names_its_requests_batch_and_line_whatever_wrote_it(sessions):
    """Results repeat their request's batch_id and line, which the result pages read from the results' index: a bad
    line's result (written at creation), a worker's response and error, worker_lost, and batch_expired."""
    from test_lifecycle import claim_and_die, expire_now

    from sluice.api.store.recovery import MAX_ATTEMPTS

    batch, work = submit(sessions, ["{bad", chat("a"), chat("b"), chat("poison")])
    a, b, poison = work.request_ids
    for attempt in range(1, MAX_ATTEMPTS + 1):
        claim_and_die(sessions, [poison], f"victim-{attempt}")
        with sessions.begin() as session:
            store.recover_expired_leases(session)
    claim(sessions, [a, b], "w1")
    write(sessions, [ok(a), failed(b, 3)], "w1")
    expiring, _ = submit(sessions, [chat("x"), chat("y")])
    expire_now(sessions, expiring.id)
    with sessions.begin() as session:
        rows = session.execute(select(Result.batch_id, Result.line, Request.batch_id, Request.line, Result.error)
                               .join(Request, Request.id == Result.request_id)).all()
    assert [(r[0], r[1]) for r in rows] == [(r[2], r[3]) for r in rows]
    codes = {(batch_id, line): error and error["code"] for batch_id, line, _, _, error in rows}
    assert codes == {(batch.id, 1): "invalid_json_line", (batch.id, 2): None, (batch.id, 3): "invalid_prompt",
                     (batch.id, 4): "worker_lost", (expiring.id, 1): "batch_expired",
                     (expiring.id, 2): "batch_expired"}


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)
def test_a_result_page_is_read_from_the_index_in_order_without_sorting_the_batch(engine, sessions):
    """Each page reads ix_results_batch_finished_line from its cursor on: no Sort of the batch's results (which cost
    up to 0.1 s a page for 50,000), whatever the cursor; and the pages still follow (finished_at, line), ties of a
    chunk written at once by their lines, each result once."""
    import random

    _, old = submit(sessions, [chat(f"o{i}") for i in range(2000)])
    batch, new = submit(sessions, [chat(f"n{i}") for i in range(3000)])
    shuffled = list(new.request_ids)
    random.Random(7).shuffle(shuffled)
    for ids in [old.request_ids] + [shuffled[k:k + 250] for k in range(0, len(shuffled), 250)]:
        claim(sessions, ids, "w1")
        write(sessions, [ok(i) for i in ids], "w1")
    with engine.begin() as connection:
        connection.execute(text("ANALYZE"))
        expected = [tuple(r) for r in connection.execute(text(
            "SELECT requests.line, results.finished_at FROM results JOIN requests ON requests.id = results.request_id "
            "WHERE requests.batch_id = :b ORDER BY results.finished_at, requests.line"), {"b": batch.id})]
    with explained(engine) as plans:
        with sessions.begin() as session:
            store.result_page(session, batch.id, None, 100)
            store.result_page(session, batch.id, expected[1500][0], 100)
    assert len(plans) == 2
    for plan in plans:
        assert "ix_results_batch_finished_line" in plan and "Sort" not in plan, plan
    seen, after, more = [], None, True
    while more:
        with sessions.begin() as session:
            page, more = store.result_page(session, batch.id, after, 97)
        seen += [(r["line"], r["finished_at"]) for r in page]
        after = page[-1]["line"]
    assert seen == expected and len(expected) == 3000
