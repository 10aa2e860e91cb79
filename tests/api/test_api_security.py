"""Security: what a caller without a key, or with one tenant's key, must not get the server or its webhooks worker to
do: hold request bodies of any size, buffer a receiver's endless answer, tell internal addresses, fan one event out
to any number of endpoints, or describe its internal hosts at /readyz."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from api_helpers import TEST_SETTINGS, chat, finish, jsonl, request_ids
from servers import serve_app
from sqlalchemy import select

from sluice.api import db, webhooks
from sluice.api.queue import make_app
from sluice.api.server import create_app
from sluice.api.store.webhooks import MAX_ENDPOINTS, MAX_URL_CHARS
from sluice.api.tables import WebhookDelivery
from sluice.api.webhooks import ERROR_CHARS, deliver

LIMIT = TEST_SETTINGS.max_file_bytes


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def raw_post(url: str, path: str, lines: list[str], timeout: float = 5.0) -> bytes:
    """POST with these header lines and no body sent: the start of what the server answers before reading one."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall("\r\n".join([f"POST {path} HTTP/1.1", f"host: {host}", *lines, "", ""]).encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:  # closed
                break
            answer += chunk
        return answer


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.mark.parametrize("path", ["/v1/requests", "/v1/batches", "/v1/webhook_endpoints"])
def test_a_json_body_without_a_valid_key_is_refused_before_it_is_read(api, path):
    answer = raw_post(api.url, path, ["content-type: application/json", f"content-length: {LIMIT}"])
    assert answer.startswith(b"HTTP/1.1 401"), answer
    answer = raw_post(api.url, path, ["content-type: application/json", "transfer-encoding: chunked",
                                      "authorization: Bearer sk-sluice-not-a-key"])
    assert answer.startswith(b"HTTP/1.1 401"), answer


def test_a_json_body_over_the_limit_is_413_with_or_without_a_length(api, tenant_key):
    key = tenant_key()
    body = {"endpoint": "/v1/chat/completions", "body": chat("a", content="x" * LIMIT)["body"]}
    content = json.dumps(body).encode()
    before = api.counts()
    answer = raw_post(api.url, "/v1/requests", ["content-type: application/json", f"content-length: {len(content)}",
                                                f"authorization: Bearer {key}"])
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer
    chunked = httpx.post(f"{api.url}/v1/requests", headers={**headers(key), "content-type": "application/json"},
                         content=iter([content[i:i + 8192] for i in range(0, len(content), 8192)]))
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large", chunked.text
    assert api.counts() == before
    small = httpx.post(f"{api.url}/v1/requests", headers=headers(key),
                       json={"endpoint": "/v1/chat/completions", "body": chat("a")["body"]})
    assert small.status_code == 200, small.text


def endless_receiver(status: int) -> tuple[str, list[int]]:
    """A receiver that answers `status` and then a body that never ends, as fast as it is read; [bytes sent]."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    sent = [0]

    def run():
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(f"HTTP/1.1 {status} X\r\ncontent-length: {10**12}\r\n\r\n".encode())
                try:
                    while True:
                        conn.sendall(b"x" * 65536)
                        sent[0] += 65536
                except OSError:
                    return
    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}/hook", sent


@pytest.mark.parametrize("status, outcome", [(500, "pending"), (200, "delivered")])
def test_a_receivers_endless_answer_is_not_read_whole(api, tenant_key, openai_client, monkeypatch, status, outcome):
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")
    monkeypatch.setattr(webhooks, "ATTEMPT_SECONDS", 3.0)
    key = tenant_key()
    url, sent = endless_receiver(status)
    assert httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(key), json={"url": url}).status_code == 200
    client = openai_client(key)
    file = client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    finish(api.sessions, list(request_ids(api.sessions, batch.id).values()))
    with api.sessions.begin() as session:
        [delivery] = session.scalars(select(WebhookDelivery.id)).all()
    started = time.monotonic()
    assert deliver(api.sessions, delivery).status == outcome
    assert time.monotonic() - started < 2.0  # not cut off by the attempt's time: it stopped reading
    with api.sessions.begin() as session:
        row = session.get(WebhookDelivery, delivery)
        assert row.last_status_code == status
        assert row.last_error == (None if status == 200 else f"HTTP 500: {'x' * ERROR_CHARS}"[:ERROR_CHARS])
    assert sent[0] < 64 * 2**20  # what socket buffers hold at most, not what 3 s of reading would take


def test_a_refused_webhook_url_does_not_tell_the_address_its_host_resolves_to(api, tenant_key, monkeypatch):
    monkeypatch.delenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", raising=False)
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(tenant_key()),
                          json={"url": "http://localhost:8080/hook"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "not a public address" in message and "127.0.0.1" not in message and "::1" not in message


@pytest.mark.parametrize("url", ["http://[64:ff9b::a9fe:a9fe]/hook", "http://[64:ff9b::a00:1]/hook",
                                 "http://[2002:a9fe:a9fe::1]/hook", "http://[2002:7f00:1::]/hook",
                                 "http://[::7f00:1]/hook"])
def test_ipv6_addresses_that_carry_a_private_ipv4_one_are_refused(api, tenant_key, monkeypatch, url):
    monkeypatch.delenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", raising=False)
    response = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(tenant_key()), json={"url": url})
    assert response.status_code == 400 and "not a public address" in response.json()["error"]["message"], response.text
    assert api.count("webhook_endpoints") == 0
    public = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers(tenant_key()),
                        json={"url": "http://[64:ff9b::101:101]/hook"})  # 1.1.1.1 through NAT64
    assert public.status_code == 200, public.text


def test_a_tenants_webhook_endpoints_are_bounded(api, tenant_key, monkeypatch):
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")
    key, other = tenant_key("acme"), tenant_key("other")
    base = f"{api.url}/v1/webhook_endpoints"
    made = [httpx.post(base, headers=headers(key), json={"url": f"http://127.0.0.1:9/{i}"}) for i in
            range(MAX_ENDPOINTS)]
    assert [r.status_code for r in made] == [200] * MAX_ENDPOINTS
    refused = httpx.post(base, headers=headers(key), json={"url": "http://127.0.0.1:9/more"})
    assert refused.status_code == 400 and str(MAX_ENDPOINTS) in refused.json()["error"]["message"]
    assert api.count("webhook_endpoints") == MAX_ENDPOINTS
    assert httpx.post(base, headers=headers(other), json={"url": "http://127.0.0.1:9/x"}).status_code == 200
    httpx.delete(f"{base}/{made[0].json()['id']}", headers=headers(key))
    again = httpx.post(base, headers=headers(key), json={"url": "http://127.0.0.1:9/again",
                                                         "events": ["batch.completed"] * 1000})
    assert again.status_code == 200 and again.json()["events"] == ["batch.completed"]
    long = httpx.post(base, headers=headers(other), json={"url": "http://127.0.0.1:9/" + "a" * MAX_URL_CHARS})
    assert long.status_code == 400 and long.json()["error"]["param"] == "url"


def test_readyz_does_not_describe_internal_hosts(api_database):
    engine = db.make_engine(api_database)
    down = create_app(db.session_factory(engine), make_app("redis://127.0.0.1:1/0"), TEST_SETTINGS)
    with serve_app(down) as url:
        response = httpx.get(f"{url}/readyz", timeout=30)
    engine.dispose()
    assert response.status_code == 503 and "broker" in response.json()
    assert "127.0.0.1" not in response.text and "Error" not in response.text
