"""Webhooks: endpoints through the API, deliveries signed per Standard Webhooks and verified by the openai SDK,
retries with the same webhook-id, giving up after a day, the SSRF guard at creation and at delivery, and the
reconcilers' sweep, which sends a delivery whose message was lost once, not once per reconciler and pass."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from api_helpers import chat, finish, jsonl, request_ids
from servers import Receiver
from sqlalchemy import select, update

from sluice.api import store, webhooks
from sluice.api.tables import WebhookDelivery
from sluice.api.webhooks import GIVE_UP_AFTER, deliver, publish_deliveries
from sluice.worker.reconcile import reconcile_once


@pytest.fixture
def receiver():
    made = []

    def make(statuses=()):
        made.append(Receiver(list(statuses)))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.fixture
def private_ok(monkeypatch):
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def register(api, key: str, url: str, **body) -> dict:
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(key), json={"url": url, **body})
    assert response.status_code == 200, response.text
    return response.json()


def complete_a_batch(api, key: str, openai_client) -> str:
    client = openai_client(key)
    file = client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    finish(api.sessions, list(request_ids(api.sessions, batch.id).values()))
    return batch.id


def deliveries(api) -> list[WebhookDelivery]:
    with api.sessions.begin() as session:
        return list(session.scalars(select(WebhookDelivery).order_by(WebhookDelivery.created_at)))


def make_due(api) -> None:
    """Time passes: every pending delivery is due again."""
    with api.sessions.begin() as session:
        session.execute(update(WebhookDelivery).values(next_attempt_at=0))


def test_endpoints_are_created_listed_and_deleted(api, tenant_key, private_ok):
    key = tenant_key()
    created = register(api, key, "http://127.0.0.1:9/hook", events=["batch.completed"])
    assert created["secret"].startswith("whsec_") and created["events"] == ["batch.completed"]
    listed = httpx.get(f"{api.url}/v1/webhook_endpoints", headers=headers(key)).json()["data"]
    assert [e["id"] for e in listed] == [created["id"]] and "secret" not in listed[0]
    one = httpx.get(f"{api.url}/v1/webhook_endpoints/{created['id']}", headers=headers(key)).json()
    assert one == listed[0]
    assert register(api, key, "http://127.0.0.1:9/all")["events"] == list(store.EVENTS)
    response = httpx.delete(f"{api.url}/v1/webhook_endpoints/{created['id']}", headers=headers(key))
    assert response.json() == {"id": created["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert httpx.get(f"{api.url}/v1/webhook_endpoints/{created['id']}", headers=headers(key)).status_code == 404
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(key),
                          json={"url": "http://127.0.0.1:9/x", "events": ["batch.done"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "events"


def test_a_completed_batch_is_delivered_signed_and_verified_by_the_sdk(api, tenant_key, openai_client, receiver,
                                                                       private_ok):
    key = tenant_key()
    hook = receiver()
    endpoint = register(api, key, hook.url)
    batch_id = complete_a_batch(api, key, openai_client)
    [pending] = deliveries(api)
    assert deliver(api.sessions, pending.id).status == "delivered"
    [(received_headers, body)] = hook.received
    event = openai.OpenAI(api_key="unused", webhook_secret=endpoint["secret"]).webhooks.unwrap(body, received_headers)
    assert (event.type, event.data.id, event.object) == ("batch.completed", batch_id, "event")
    assert received_headers["webhook-id"] == pending.id and event.id.startswith("evt_")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused", webhook_secret="whsec_" + "A" * 32).webhooks.unwrap(body, received_headers)
    assert deliver(api.sessions, pending.id).status == "skipped"  # delivered once: never again
    [row] = httpx.get(f"{api.url}/v1/webhook_endpoints/{endpoint['id']}/deliveries", headers=headers(key)).json()[
        "data"]
    assert (row["status"], row["attempts"], row["last_status_code"], row["next_attempt_at"]) == (
        "delivered", 1, 200, None)


def test_a_500_is_retried_later_with_the_same_webhook_id(api, tenant_key, openai_client, receiver, private_ok):
    key = tenant_key()
    hook = receiver([500])
    endpoint = register(api, key, hook.url)
    complete_a_batch(api, key, openai_client)
    [pending] = deliveries(api)
    before = time.time()
    first = deliver(api.sessions, pending.id)
    assert first.status == "pending" and before + 2.5 <= first.next_attempt_at <= time.time() + 7.5
    assert deliver(api.sessions, pending.id).status == "skipped"  # not due yet
    listed = httpx.get(f"{api.url}/v1/webhook_endpoints/{endpoint['id']}/deliveries", headers=headers(key)).json()
    assert listed["data"][0]["status"] == "pending" and listed["data"][0]["last_status_code"] == 500
    make_due(api)
    assert deliver(api.sessions, pending.id).status == "delivered"
    (first_headers, first_body), (second_headers, second_body) = hook.received
    assert first_headers["webhook-id"] == second_headers["webhook-id"] == pending.id and first_body == second_body
    openai.OpenAI(api_key="unused", webhook_secret=endpoint["secret"]).webhooks.unwrap(second_body, second_headers)
    [row] = deliveries(api)
    assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("delivered", 2, 200, None)


def test_backoff_doubles_and_gives_up_after_a_day(api, tenant_key, openai_client, private_ok):
    key = tenant_key()
    endpoint = register(api, key, "http://127.0.0.1:9/closed")  # nothing listens on port 9
    complete_a_batch(api, key, openai_client)
    [pending] = deliveries(api)
    delays = []
    for _ in range(4):
        start = time.time()
        outcome = deliver(api.sessions, pending.id)
        delays.append(outcome.next_attempt_at - start)
        make_due(api)
    assert all(2.5 * 2 ** n <= d <= 7.5 * 2 ** n + 1 for n, d in enumerate(delays)), delays
    with api.sessions.begin() as session:
        session.execute(update(WebhookDelivery).values(created_at=time.time() - GIVE_UP_AFTER))
    assert deliver(api.sessions, pending.id).status == "failed"
    [row] = httpx.get(f"{api.url}/v1/webhook_endpoints/{endpoint['id']}/deliveries", headers=headers(key)).json()[
        "data"]
    assert row["status"] == "failed" and row["attempts"] == 5 and row["last_status_code"] is None
    assert "ConnectError" in row["last_error"] and row["next_attempt_at"] is None


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "http://10.0.0.1/hook",
                                 "http://localhost:8080/hook", "https://127.0.0.1/hook", "http://[::1]/hook",
                                 "http://[::ffff:10.0.0.1]/hook", "http://100.100.100.200/hook"])
def test_the_ssrf_guard_refuses_private_addresses_at_creation(api, tenant_key, url, monkeypatch):
    monkeypatch.delenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", raising=False)
    key = tenant_key()
    before = api.counts()
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(key), json={"url": url})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("url_not_allowed", "url") and "not a public address" in error["message"]
    assert api.counts() == before


def test_the_ssrf_guard_also_runs_at_delivery(api, tenant_key, openai_client, receiver, monkeypatch):
    key = tenant_key()
    hook = receiver()
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")
    register(api, key, hook.url)
    complete_a_batch(api, key, openai_client)
    monkeypatch.delenv("SLUICE_WEBHOOK_ALLOW_PRIVATE")  # as if the name now resolved somewhere private
    [pending] = deliveries(api)
    assert deliver(api.sessions, pending.id).status == "pending"
    assert hook.received == []
    [row] = deliveries(api)
    assert "not a public address" in row.last_error and row.last_status_code is None


def test_only_wanted_events_are_written_and_published_after_commit(api, tenant_key, openai_client, private_ok):
    key = tenant_key()
    register(api, key, "http://127.0.0.1:9/done", events=["batch.completed"])
    register(api, key, "http://127.0.0.1:9/cancel", events=["batch.cancelled"])
    client = openai_client(key)
    file = client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    client.batches.cancel(batch.id)
    [row] = deliveries(api)
    assert row.event_type == "batch.cancelled" and row.payload["data"] == {"id": batch.id}
    # the cancel route sent its delivery message to the webhooks queue
    [message] = [json.loads(m) for m in api.redis.lrange("webhooks", 0, -1)]
    assert message["headers"]["task"] == "sluice.deliver_webhook" and message["headers"]["argsrepr"] == repr(
        [row.id])
    api.redis.delete("webhooks")
    publish_deliveries(api.celery, [row.id])
    assert api.redis.llen("webhooks") == 1
    with api.sessions.begin() as session:
        assert store.due_deliveries(session, time.time()) == [row.id]
        assert store.due_deliveries(session, row.created_at - 1) == []


@pytest.mark.parametrize("url, words", [
    ("http://1.1.1.1:99999/", "Port out of range"), ("http://1.1.1.1:abc/", "could not be cast to integer"),
    ("http://[::1/", "Invalid IPv6 URL"), ("http://1.1.1.1/a\x00b", "NUL character"),
    ("http://1.1.1.1/\ud800", "lone surrogate"),
])
def test_urls_that_cannot_be_parsed_or_stored_are_400(api, tenant_key, url, words):
    auth = {**headers(tenant_key()), "content-type": "application/json"}
    before = api.counts()
    # json.dumps escapes the surrogate, which httpx's own encoding (UTF-8) cannot hold
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", content=json.dumps({"url": url}), headers=auth)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("url_not_allowed", "url") and words in error["message"]
    assert api.counts() == before


def test_endpoint_ids_and_cursors_no_row_can_have_are_not_found(api, tenant_key, private_ok):
    key = tenant_key()
    endpoint = register(api, key, "http://127.0.0.1:9/hook")["id"]
    base = f"{api.url}/v1/webhook_endpoints"
    for method, path in [("GET", "/%00"), ("DELETE", "/%00"), ("GET", "/%00/deliveries")]:
        response = httpx.request(method, base + path, headers=headers(key))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", (method, path)
    response = httpx.get(f"{base}/{endpoint}/deliveries", params={"after": "\x00"}, headers=headers(key))
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    assert api.count("webhook_endpoints") == 1


def test_the_sweep_sends_a_lost_delivery_once_whatever_the_number_of_reconcilers(api, tenant_key, openai_client,
                                                                                   private_ok):
    """Every worker reconciles every few seconds: each pass sent every due delivery again, so while the webhooks
    worker was down a delivery gathered a message per worker and pass (thousands a day)."""
    key = tenant_key()
    register(api, key, "http://127.0.0.1:9/hook")
    complete_a_batch(api, key, openai_client)
    api.redis.delete("webhooks")  # the message sent after commit was lost

    def sweep(times: int) -> int:
        with ThreadPoolExecutor(4) as pool:  # four workers' reconcilers at once
            list(pool.map(lambda _: reconcile_once(api.sessions, api.celery, stale_seconds=30), range(times)))
        return api.redis.llen("webhooks")

    assert sweep(4) == 0  # due for less than stale_seconds: its message may well be on its way
    with api.sessions.begin() as session:
        session.execute(update(WebhookDelivery).values(next_attempt_at=time.time() - 60))
    assert sweep(8) == 1
    [row] = deliveries(api)
    assert row.status == "pending" and row.next_attempt_at > time.time() - 30  # still due, stamped as sent now
    assert deliver(api.sessions, row.id).status == "pending"  # the message's attempt is not refused for the stamp


def trickling_receiver(seconds: float) -> str:
    """A receiver that answers one byte every half second for `seconds`: each read is quick, the answer is not."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        with server, server.accept()[0] as conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            try:
                for _ in range(int(seconds * 2)):
                    time.sleep(0.5)
                    conn.sendall(b"x")
                conn.sendall(b"-a: b\r\ncontent-length: 0\r\n\r\n")
            except OSError:  # the sender hung up
                pass
    threading.Thread(target=answer, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}/hook"


def test_an_attempt_ends_within_its_time_however_slowly_the_receiver_answers(api, tenant_key, openai_client,
                                                                             private_ok, monkeypatch):
    """The 10 s timeout bounds each read: a receiver trickling its answer kept an attempt going past its claim, and
    the sweep then sent the delivery again while the first attempt was still in flight."""
    monkeypatch.setattr(webhooks, "ATTEMPT_SECONDS", 2.0)
    key = tenant_key()
    register(api, key, trickling_receiver(8))
    complete_a_batch(api, key, openai_client)
    [pending] = deliveries(api)
    start = time.time()
    outcome = deliver(api.sessions, pending.id)
    assert outcome.status == "pending" and time.time() - start < 5
    [row] = deliveries(api)
    assert row.last_error == "no complete answer within 2 s" and row.last_status_code is None
