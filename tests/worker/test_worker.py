"""The queue-driven GPU worker against a real PostgreSQL, Redis and `sluice worker` processes."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from servers import free_port
from sqlalchemy import func, select, text

from sluice.api import store
from sluice.api.tables import EfficiencyWindow, Request, Result
from sluice.worker.engine import LLM, LLMEngine, SamplingParams
from sluice.worker.gpu_worker import ChunkOutcome, GpuWorker, WorkerSettings

PROMPTS = [f"Request number {i}: {'beautiful is better than ugly ' * (i % 5)}" for i in range(24)]


def chat(i: int, max_tokens: int, **body) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def completion(i: int, max_tokens: int, **body) -> dict:
    return {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, **body}}


def long_batch(n: int = 24, max_tokens: int = 1200) -> list[dict]:
    return [completion(i, max_tokens, ignore_eos=True) for i in range(n)]


def engine_worker(cluster, name: str = "tiny", **settings) -> GpuWorker:
    """A GPU worker in the test's own process, not started, on the tiny model; no Celery consumes for it."""
    settings = WorkerSettings(name, str(cluster.model_dir), cpu_pinning=False, engine_threads=1, **settings)
    return GpuWorker(partial(LLMEngine, str(cluster.model_dir), num_kv_blocks=256), settings, cluster.sessions,
                     cluster.app)


def request_ids(cluster, batch_id: str) -> list[int]:
    with cluster.sessions.begin() as s:
        return s.scalars(select(Request.id).where(Request.batch_id == batch_id).order_by(Request.id)).all()


def exactly_one_result_each(cluster, batch_id: str) -> None:
    with cluster.sessions.begin() as s:
        per_request = s.execute(select(Request.id, func.count(Result.request_id))
                                .outerjoin(Result, Result.request_id == Request.id)
                                .where(Request.batch_id == batch_id).group_by(Request.id)).all()
    assert per_request and all(n == 1 for _, n in per_request), per_request


def test_results_equal_the_engines_greedy_output(cluster, llama_dir):
    chats = [chat(i, 4 + i % 9) for i in range(12)]
    chats.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}})
    completions = [completion(i, 5 + i % 7) for i in range(12)]
    completions.append(completion(99, 8) | {"custom_id": "too-long", "body": {"prompt": "x " * 3000,
                                                                               "max_tokens": 8}})
    metrics_port = free_port()
    cluster.start_worker("--metrics-port", str(metrics_port), "--window-seconds", "0.5")
    chat_batch, completion_batch = cluster.submit(chats), cluster.submit(completions)
    views = [cluster.wait_status(b, ("completed",)) for b in (chat_batch, completion_batch)]
    assert [v["request_counts"] for v in views] == [{"total": 13, "completed": 12, "failed": 1}] * 2

    llm = LLM(str(llama_dir))
    for batch_id, lines in ((chat_batch, chats[:12]), (completion_batch, completions[:12])):
        results = cluster.results(batch_id)
        for line in lines:
            body = line["body"]
            params = SamplingParams(max_tokens=body["max_tokens"], temperature=0)
            choice = results[line["custom_id"]]["response"]["body"]["choices"][0]
            if "messages" in body:
                expected, got = llm.chat(body["messages"], params)[0], choice["message"]["content"]
            else:
                expected, got = llm.generate(body["prompt"], params)[0], choice["text"]
            assert got == expected.text
            usage = results[line["custom_id"]]["response"]["body"]["usage"]
            assert usage["completion_tokens"] == len(expected.token_ids)
            assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert cluster.errors(chat_batch)["bad"]["error"]["code"] == "invalid_value"
    too_long = cluster.errors(completion_batch)["too-long"]["error"]
    assert too_long["code"] == "context_length_exceeded" and "max_model_len" in too_long["message"]

    usage = views[1]["usage"]
    results = cluster.results(completion_batch)
    assert usage["output_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                         for r in results.values())
    assert usage["gpu_seconds"] > 0
    assert usage["cost"] == pytest.approx(usage["gpu_seconds"] * 3.6 / 3600)
    rows = cluster.result_rows(completion_batch)
    assert all(r.e2e_seconds >= r.ttft_seconds >= r.queue_seconds >= 0 for r in rows if r.error is None)

    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    generated = sum(r.completion_tokens for b in (chat_batch, completion_batch) for r in cluster.result_rows(b))
    assert f'sluice:engine_generation_tokens_total{{model_name="tiny"}} {float(generated)}' in scraped
    assert 'sluice:engine_num_requests_running{model_name="tiny"} 0.0' in scraped
    assert 'sluice:engine_e2e_request_latency_seconds_count{model_name="tiny"} 24.0' in scraped

    cluster.workers[0].send_signal(signal.SIGTERM)  # a clean stop writes the last efficiency window
    assert cluster.workers[0].wait(timeout=60) == 0
    with cluster.sessions.begin() as s:
        windows = s.scalars(select(EfficiencyWindow).order_by(EfficiencyWindow.window_start)).all()
        assert sum(w.decode_tokens for w in windows) > 0
        # --window-seconds 0.5 (the default is 10 s): each window closes at the first engine-loop pass after 0.5 s (a
        # slow step may delay one; the last one, at the stop, is shorter), and each starts where the one before ended
        assert len(windows) >= 2 and all(0.5 <= w.window_end - w.window_start < 5 for w in windows[:-1])
        assert all(a.window_end == pytest.approx(b.window_start) for a, b in zip(windows, windows[1:]))
        assert all(0 <= w.mean_running_seqs <= w.max_num_seqs and 0 <= w.kv_cache_use <= 1 for w in windows)
        assert store.live_workers(s) == []


def test_kill_9_mid_batch_then_a_new_worker_finishes_it_exactly_once(cluster):
    first = cluster.start_worker("--max-num-seqs", "2")
    batch_id = cluster.submit(long_batch())
    cluster.wait_finished(batch_id, 4)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = cluster.finished(batch_id)
    assert done_before < 24, "the batch finished before the kill; make it longer"
    cluster.start_worker("--max-num-seqs", "8")
    view = cluster.wait_status(batch_id, ("completed",), timeout=180)
    assert view["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    exactly_one_result_each(cluster, batch_id)
    with cluster.sessions.begin() as s:
        assert s.scalar(select(func.max(Request.attempts)).where(Request.batch_id == batch_id)) >= 2


def test_a_message_delivered_twice_gives_one_result(cluster):
    lines = [completion(i, 6) for i in range(8)]
    batch_id = cluster.submit(lines)
    with cluster.sessions.begin() as s:
        ids = s.scalars(select(Request.id).where(Request.batch_id == batch_id)).all()
    from sluice.api.queue import publish_chunks
    from sluice.api.store.batches import Work

    publish_chunks(cluster.app, [Work("tiny", 5, sorted(ids))] * 2, size=4)  # every chunk twice more
    cluster.start_worker()
    view = cluster.wait_status(batch_id, ("completed",))
    assert view["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    deadline = time.time() + 60  # the duplicate messages are consumed too, however slow the machine
    while cluster.redis.llen("model.tiny:5") and time.time() < deadline:
        time.sleep(0.1)
    assert cluster.redis.llen("model.tiny:5") == 0
    time.sleep(1)  # the last ones taken have run (and skipped their finished requests)
    exactly_one_result_each(cluster, batch_id)


def test_redis_flushed_mid_batch_the_reconciler_completes_it(cluster):
    cluster.start_worker("--max-num-seqs", "2")
    batch_id = cluster.submit(long_batch(24, 600))
    cluster.wait_finished(batch_id, 2)
    cluster.redis.flushdb()  # every waiting message is gone
    with cluster.sessions.begin() as s:
        assert s.scalar(select(func.count()).where(Request.batch_id == batch_id, Request.status == "queued")) > 0
    view = cluster.wait_status(batch_id, ("completed",), timeout=180)
    assert view["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    exactly_one_result_each(cluster, batch_id)


def test_cancel_mid_batch_keeps_finished_results(cluster):
    cluster.start_worker("--max-num-seqs", "2")
    batch_id = cluster.submit(long_batch())
    cluster.wait_finished(batch_id, 2)
    with cluster.sessions.begin() as s:
        store.cancel_batch(s, batch_id)
    view = cluster.wait_status(batch_id, ("cancelled",), timeout=60)
    finished = view["request_counts"]["completed"]
    assert 2 <= finished < 24 and view["request_counts"]["failed"] == 0
    assert len(cluster.results(batch_id)) == finished
    with cluster.sessions.begin() as s:
        statuses = dict(s.execute(select(Request.status, func.count()).where(Request.batch_id == batch_id)
                                  .group_by(Request.status)).all())
    assert statuses == {"completed": finished, "cancelled": 24 - finished}


def test_expired_batch_gets_batch_expired_error_lines(cluster):
    cluster.start_worker("--max-num-seqs", "2")
    batch_id = cluster.submit(long_batch())
    cluster.wait_finished(batch_id, 2)
    with cluster.sessions.begin() as s:  # the completion window passes now
        s.execute(text("UPDATE batches SET expires_at = :t WHERE id = :id"), {"t": time.time() - 1, "id": batch_id})
    view = cluster.wait_status(batch_id, ("expired",), timeout=30)
    counts = view["request_counts"]
    assert counts["completed"] + counts["failed"] == 24 and counts["failed"] > 0
    errors = cluster.errors(batch_id)
    assert len(errors) == counts["failed"] and {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    time.sleep(2)
    exactly_one_result_each(cluster, batch_id)
    assert cluster.batch(batch_id)["request_counts"] == counts


def test_two_workers_share_a_batch_without_duplicating_work(cluster):
    cluster.start_worker("--max-num-seqs", "2")
    cluster.start_worker("--max-num-seqs", "2")
    cluster.wait_live(2)
    batch_id = cluster.submit(long_batch(32, 40))
    view = cluster.wait_status(batch_id, ("completed",), timeout=180)
    assert view["request_counts"] == {"total": 32, "completed": 32, "failed": 0}
    exactly_one_result_each(cluster, batch_id)
    assert len({r.worker_id for r in cluster.result_rows(batch_id)}) == 2
    with cluster.sessions.begin() as s:
        assert s.scalar(select(func.max(Request.attempts)).where(Request.batch_id == batch_id)) == 1


def test_sigterm_gives_unfinished_requests_back(cluster):
    first = cluster.start_worker("--max-num-seqs", "2")
    batch_id = cluster.submit(long_batch(16, 1500))
    cluster.wait_finished(batch_id, 1)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0  # grace of 5 s, then in-flight requests are released
    assert cluster.finished(batch_id) < 16
    with cluster.sessions.begin() as s:
        assert not s.scalar(select(func.count()).where(Request.batch_id == batch_id, Request.status == "running"))
    cluster.start_worker("--max-num-seqs", "8")
    view = cluster.wait_status(batch_id, ("completed",), timeout=240)
    assert view["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    exactly_one_result_each(cluster, batch_id)


def test_an_idle_worker_exits_on_sigterm_without_waiting_out_the_grace_period(cluster):
    worker = cluster.start_worker("--shutdown-grace-seconds", "120")  # the last flag wins over the fixture's 5
    cluster.wait_live(1)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=40) == 0  # it waited the whole 120 s while the grace timer kept the process alive
    with cluster.sessions.begin() as s:
        assert not store.live_workers(s)  # its last heartbeat said "stopped"


def test_a_model_without_a_live_worker_stays_queued_and_says_so(cluster):
    batch_id = cluster.submit([completion(0, 4)])
    view = cluster.batch(batch_id)
    assert view["status"] == "in_progress" and view["waiting_for_worker"] is True


def test_the_worker_rides_out_its_database_connections_being_killed(cluster):
    """A Postgres restart or failover drops every connection: the worker's pool pings nothing before use, so the
    next transaction hits a dead connection; it must retry on a fresh one, not fail the chunk or the worker."""
    worker = cluster.start_worker("--max-num-seqs", "4")
    # long enough that chunks are still running at the kill: their lease renewals (every second here) go through
    # the retrying transaction; a batch already done left only the reconciler to meet the dead connection (it logs
    # its own message and the pool then reconnects quietly), which is how this test once failed
    batch_id = cluster.submit(long_batch(16, 600))
    cluster.wait_finished(batch_id, 4)  # the worker's pool holds connections by now
    with cluster.engine.connect() as c:
        killed = c.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar()
    assert killed >= 1
    assert cluster.finished(batch_id) < 16, "the batch finished before the kill: the test checked nothing"
    view = cluster.wait_status(batch_id, ("completed",), timeout=180)
    assert view["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    exactly_one_result_each(cluster, batch_id)
    assert worker.poll() is None
    # whichever thread meets a dead connection first (a chunk's write, the heartbeat, the reconciler) retries it
    assert "database error, retrying" in cluster.log_text(), cluster.log_tail()


def test_a_worker_is_live_only_once_celery_consumes_its_queue(cluster):
    """Built but not consuming, a worker would take no message: it must not count as serving its model (a batch
    would say no worker is waiting when none takes its work, and a test or a bench starting on it races)."""
    from sluice.api.tables import Worker

    worker = engine_worker(cluster, "starting-model")

    def row() -> tuple[str, list[str]]:
        with cluster.sessions.begin() as s:
            return s.get(Worker, worker.id).status, [w.id for w in store.live_workers(s, "starting-model")]

    worker.start()
    try:
        assert row() == ("starting", [])
        worker.mark_consuming()  # what Celery's worker_ready signal calls
        assert row() == ("running", [worker.id])
    finally:
        worker.close()
    assert row() == ("stopped", [])


def test_a_request_sent_again_to_the_worker_still_running_it_keeps_its_real_result(cluster, monkeypatch):
    """Renewals failing for longer than the lease (a database outage) let it run out, and the reconciler sends the
    request again; in a one-worker deployment this same worker takes the message. The chunk running it must store its
    result: claimed a second time, the engine refused the duplicate id and that refusal was stored instead."""
    worker = engine_worker(cluster, lease_seconds=0.5, reconcile_seconds=600)
    monkeypatch.setattr(worker.maintenance, "renew_leases", lambda: None)  # the outage, for renewals
    batch_id = cluster.submit([completion(0, 200, ignore_eos=True)])
    ids = request_ids(cluster, batch_id)
    worker.start()
    # the first chunk waits on its request until the second message has come, however fast the machine runs it
    second_came, submit_many = threading.Event(), worker.bridge.submit_many
    monkeypatch.setattr(worker.bridge, "submit_many",
                        lambda submits: [submit_many(submits), submits and second_came.wait(60)][0])
    try:
        first = ThreadPoolExecutor(1).submit(worker.run_chunk, ids)
        deadline = time.time() + 30
        while not lease_ran_out(cluster) and time.time() < deadline:  # a reconciler now sends the request again
            time.sleep(0.05)
        assert lease_ran_out(cluster)
        assert worker.run_chunk(ids) == ChunkOutcome([], [])
        assert not first.done()
        second_came.set()
        assert first.result(timeout=120) == ChunkOutcome(ids, [])
    finally:
        worker.close()
    (row,) = cluster.result_rows(batch_id)
    assert row.error is None and row.completion_tokens == 200


def lease_ran_out(cluster) -> bool:
    with cluster.sessions.begin() as s:
        status, expires = s.execute(select(Request.status, Request.lease_expires_at)).one()
    return status == "running" and expires < time.time()


def test_a_chunk_claimed_after_the_engine_stopped_is_given_back(cluster):
    """The engine stopped or died between the task's check and its submit: the requests never ran, so they are
    queued again without using an attempt, and the message goes back to the queue."""
    from celery.exceptions import Reject

    from sluice.worker import tasks
    from sluice.worker.gpu_worker import install

    worker = engine_worker(cluster, reconcile_seconds=600)
    batch_id = cluster.submit([completion(i, 4) for i in range(2)])
    ids = request_ids(cluster, batch_id)
    worker.start()
    install(worker)
    try:
        worker.bridge.stop(timeout=30)
        with pytest.raises(Reject) as rejected:
            tasks.run_chunk(ids)
        assert rejected.value.requeue
    finally:
        install(None)
        worker.close()
    with cluster.sessions.begin() as s:
        rows = s.execute(select(Request.status, Request.attempts, Request.lease_owner)
                         .where(Request.batch_id == batch_id)).all()
    assert rows == [("queued", 0, None)] * 2


def broker_down():
    from sluice.api.queue import make_app

    return make_app(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there


def test_a_broker_down_when_a_chunk_finishes_its_batch_fails_nothing(cluster):
    """The chunk's transaction completed the batch and wrote its webhook delivery; publishing that delivery then
    failed, and the task raised after its results were stored. Now it is logged and the sweep sends it later."""
    from sluice.api.tables import WebhookDelivery

    with cluster.sessions.begin() as s:
        store.create_webhook_endpoint(s, store.get_or_create_tenant(s, "acme").id, "https://example.com/hook")
    batch_id = cluster.submit([completion(i, 2) for i in range(2)])
    ids = request_ids(cluster, batch_id)
    settings = WorkerSettings("tiny", str(cluster.model_dir), cpu_pinning=False, engine_threads=1,
                              reconcile_seconds=600)
    worker = GpuWorker(partial(LLMEngine, str(cluster.model_dir), num_kv_blocks=256), settings, cluster.sessions,
                       broker_down())
    worker.start()
    try:
        assert worker.run_chunk(ids) == ChunkOutcome(ids, [])
    finally:
        worker.close()
    assert cluster.batch(batch_id)["status"] == "completed"
    with cluster.sessions.begin() as s:
        assert s.scalars(select(WebhookDelivery.status)).all() == ["pending"]


def test_a_broker_down_does_not_stop_the_reconciler_expiring_batches(cluster):
    from sluice.worker.reconcile import reconcile_once

    waiting = cluster.submit([completion(0, 2)])  # its model's queue is asked for: the broker fails that
    batch_id = cluster.submit([completion(i, 2) for i in range(2)])
    with cluster.sessions.begin() as s:
        s.execute(text("UPDATE batches SET expires_at = :t WHERE id = :id"), {"t": time.time() - 1, "id": batch_id})
    assert reconcile_once(cluster.sessions, broker_down(), stale_seconds=0) == 0
    assert cluster.batch(batch_id)["status"] == "expired"
    assert cluster.batch(waiting)["status"] == "in_progress"


def test_workers_wait_out_a_broker_outage_however_long():
    from sluice.api.queue import make_app

    conf = make_app("redis://127.0.0.1:6379/0").conf
    assert conf.broker_connection_max_retries is None and conf.broker_connection_retry_on_startup
