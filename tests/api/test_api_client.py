"""api.client against the live server, with requests finished through the store by a helper thread (as a worker
would), against a tiny server that fails before it answers, and (for its retry decisions) against an httpx
MockTransport that fails after doing the work."""

from __future__ import annotations

import json
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest
from api_helpers import chat, finish, jsonl
from sqlalchemy import select, update

import sluice.api.client
from sluice.api.client import MAX_WAIT, Client, SluiceError, text_of
from sluice.api.tables import Request, Result


def finish_in_rounds(api, batch_id: str, rounds: int, failed_every: int = 0) -> threading.Thread:
    """A worker stand-in: finishes the batch's queued requests in `rounds` steps, a little apart."""
    def run():
        ids = []
        while not ids:
            with api.sessions.begin() as session:
                ids = list(session.scalars(select(Request.id).where(Request.batch_id == batch_id,
                                                                    Request.status == "queued")
                                           .order_by(Request.id.desc())))
            time.sleep(0.02)
        step = -(-len(ids) // rounds)
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            failed = tuple(i for i in chunk if failed_every and i % failed_every == 0)
            finish(api.sessions, chunk, {i: f"text {i}" for i in chunk}, failed=failed)
            time.sleep(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def client(api, tenant_key):
    with Client(api.url, tenant_key(), poll_interval=0.05, backoff=0.01) as c:
        yield c


def test_submit_wait_and_iterate_results_as_they_finish(api, client, capsys):
    bodies = [chat(str(i))["body"] for i in range(7)]
    batch = client.submit(bodies, metadata={"job": "x"})
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 7
    worker = finish_in_rounds(api, batch["id"], rounds=3, failed_every=3)
    results = list(client.results(batch["id"]))
    worker.join()
    assert sorted(r["custom_id"] for r in results) == [str(i) for i in range(7)]
    assert [r["finished_at"] for r in results] == sorted(r["finished_at"] for r in results)
    assert [r["custom_id"] for r in results[:3]] == ["4", "5", "6"]  # the last lines finish first, together
    texts = {r["custom_id"]: text_of(r) for r in results}
    assert sum(t is None for t in texts.values()) == 2 and all(t.startswith("text ") for t in texts.values() if t)
    done = client.wait(batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    assert "7/7" in capsys.readouterr().err  # the progress bar, on stderr


def test_results_catch_a_result_committed_behind_the_cursor(api, client):
    batch = client.submit([chat(str(i))["body"] for i in range(3)])
    with api.sessions.begin() as session:
        ids = list(session.scalars(select(Request.id).where(Request.batch_id == batch["id"]).order_by(Request.id)))
    finish(api.sessions, [ids[2]])
    results = client.results(batch["id"])
    assert next(results)["custom_id"] == "2"
    finish(api.sessions, [ids[1], ids[0]])
    with api.sessions.begin() as session:  # as if one result had committed late, with an earlier finish time
        session.execute(update(Result).where(Result.request_id == ids[0]).values(finished_at=0.0))
    assert sorted(r["custom_id"] for r in results) == ["0", "1"]


def test_submit_a_jsonl_file_and_cancel(api, client, tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_bytes(jsonl([chat("a"), chat("b")]))
    batch = client.submit(path)
    assert batch["endpoint"] == "/v1/chat/completions" and batch["request_counts"]["total"] == 2
    assert client.cancel(batch["id"])["status"] == "cancelled"
    assert client.wait(batch["id"], progress=False)["status"] == "cancelled"
    assert list(client.results(batch["id"])) == []


def test_map_documents_keys_results_by_document(api, client):
    documents = {"doc-a": "Alpha text", "doc-b": "Beta {text} with braces {}"}
    batch_ids = []

    def worker():
        while not batch_ids:
            with api.sessions.begin() as session:
                batch_ids.extend(session.scalars(select(Request.batch_id).distinct()))
            time.sleep(0.02)
        finish_in_rounds(api, batch_ids[0], rounds=1).join()
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    results = client.map_documents('Summarise {id}: {text} as {"json": true}', documents, model="tiny",
                                   max_tokens=8, progress=False)
    thread.join()
    assert set(results) == {"doc-a", "doc-b"} and all(text_of(r).startswith("text ") for r in results.values())
    with api.sessions.begin() as session:
        bodies = dict(session.execute(select(Request.custom_id, Request.body)).all())
    assert bodies["doc-a"]["messages"][0]["content"] == 'Summarise doc-a: Alpha text as {"json": true}'
    assert bodies["doc-b"]["max_tokens"] == 8 and bodies["doc-b"]["model"] == "tiny"


def test_errors_carry_the_servers_message(api, client):
    with pytest.raises(SluiceError) as missing:
        client.batch("batch_nope")
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    assert missing.value.message == "batch batch_nope not found" and "HTTP 404" in str(missing.value)
    with pytest.raises(SluiceError) as refused:
        client.submit([chat("a", model="huge")["body"]])
    assert refused.value.status == 400 and refused.value.code == "model_not_found"


class Flaky:
    """Answers each GET with the next of `statuses`, then with a batch object."""

    def __init__(self, statuses: list[int]):
        self.statuses, self.calls = list(statuses), 0
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                flaky.calls += 1
                status = flaky.statuses.pop(0) if flaky.statuses else 200
                body = {"id": "batch_x", "status": "completed"} if status == 200 else {
                    "error": {"message": f"try again ({status})", "type": "server_error", "param": None,
                              "code": "busy"}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(data)))
                if status == 429:
                    self.send_header("retry-after", "0")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_retries_429_and_5xx_then_gives_up_with_the_message():
    flaky = Flaky([503, 429])
    try:
        with Client(flaky.url + "/v1", "key", backoff=0.01) as client:
            assert client.batch("batch_x") == {"id": "batch_x", "status": "completed"}
            assert flaky.calls == 3
        flaky.statuses, flaky.calls = [500] * 10, 0
        with Client(flaky.url, "key", backoff=0.01, max_retries=2) as client:
            with pytest.raises(SluiceError) as failed:
                client.batch("batch_x")
            assert flaky.calls == 3 and failed.value.status == 500 and failed.value.message == "try again (500)"
        flaky.statuses, flaky.calls = [404], 0
        with Client(flaky.url, "key", backoff=0.01) as client:
            with pytest.raises(SluiceError):
                client.batch("batch_x")
            assert flaky.calls == 1  # a 4xx other than 429 is not retried
    finally:
        flaky.close()


def failing(failure: type[httpx.TransportError] | int, request: httpx.Request) -> httpx.Response:
    """An answer of status `failure`, or its exception raised as the client would see it."""
    if isinstance(failure, int):
        return httpx.Response(failure, json={"error": {"message": f"failed ({failure})", "code": "busy"}})
    raise failure(f"{failure.__name__} on the way", request=request)


def mock_client(answer, **kwargs: object) -> tuple[Client, list[str]]:
    """A client whose requests `answer(request)` handles, and the "METHOD path" of each request it was sent."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        return answer(request)
    return Client("http://sluice.test", "key", backoff=0.001, transport=httpx.MockTransport(handle), **kwargs), sent


@pytest.mark.parametrize("failure", [httpx.ReadTimeout, httpx.WriteTimeout, httpx.RemoteProtocolError, 500, 502])
def test_a_post_is_retried_until_the_server_may_have_acted_on_it(failure):
    created = []
    before = [httpx.ConnectError, httpx.ConnectTimeout, 429, 503]  # never sent, or refused before any work

    def answer(request):
        if request.url.path == "/v1/files":
            return httpx.Response(200, json={"id": "file_x"})
        if request.method == "POST" and before:
            return failing(before.pop(0), request)
        created.append(request.url.path)  # the work is done; the client does not hear of it
        return failing(failure, request)
    client, sent = mock_client(answer)
    with pytest.raises(SluiceError) as failed:
        client.submit([chat("a")["body"]])
    assert sent == ["POST /v1/files"] + ["POST /v1/batches"] * 5 and created == ["/v1/batches"]
    assert "POST /batches was not retried, as the server may have acted on it" in str(failed.value)
    sent.clear()
    with pytest.raises(SluiceError) as failed:
        client.batch("batch_x")  # a GET that fails the same way is retried: reading twice does no harm
    assert sent == ["GET /v1/batches/batch_x"] * 6 and "not retried" not in str(failed.value)


def test_map_documents_does_not_create_its_batch_twice():
    def answer(request):
        if request.url.path == "/v1/files":
            return httpx.Response(200, json={"id": "file_x"})
        return failing(httpx.ReadTimeout, request)
    client, sent = mock_client(answer)
    with pytest.raises(SluiceError, match="not retried"):
        client.map_documents("{text}", {"doc": "text"}, model="tiny", progress=False)
    assert sent == ["POST /v1/files", "POST /v1/batches"]


def test_retry_after_in_seconds_decimals_or_a_date_is_honoured_up_to_a_cap(monkeypatch):
    waits = []
    monkeypatch.setattr(sluice.api.client, "time", SimpleNamespace(sleep=waits.append, time=time.time))
    headers = ["3", "1.5", formatdate(time.time() + 8, usegmt=True), "86400", "soon", "-5"]

    def answer(request):
        if headers:
            return httpx.Response(503, headers={"retry-after": headers.pop(0)}, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"id": "batch_x"})
    client, _ = mock_client(answer, max_retries=6)
    assert client.batch("batch_x") == {"id": "batch_x"}
    assert waits[:2] == [3.0, 1.5] and 6 < waits[2] <= 8 and waits[3] == MAX_WAIT == 60
    assert 0 < waits[4] < 1 and waits[5] == 0  # an unreadable header falls back to the backoff; a past one waits 0
