"""/v1/files with the openai SDK: upload, list with pages, get, download, delete; refused uploads change nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from api_helpers import TEST_SETTINGS, chat, jsonl

from sluice.api.routes_files import MULTIPART_SLACK
from sluice.api.server import create_app


def test_upload_list_get_content_delete(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    data = jsonl([chat("a"), chat("b")])
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (len(data), "input.jsonl",
                                                                                       "batch", "processed")
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == data
    assert [f.id for f in client.files.list()] == [uploaded.id]

    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    assert list(client.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert api.count("file_contents") == 0


def test_a_download_streams_the_file_a_slice_at_a_time(api, tenant_key, openai_client, monkeypatch):
    """A stored file is read a slice per transaction (a whole 200 MB one took 1.3 GB of the server's memory)."""
    from sluice.api import routes_files, store

    reads = []
    monkeypatch.setattr(routes_files, "FILE_SLICE", 100)
    monkeypatch.setattr(store, "file_slice", lambda *args: reads.append(args[2:]) or store.files.file_slice(*args))
    client = openai_client(tenant_key())
    data = jsonl([chat(f"c{i}") for i in range(5)])
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    response = client.files.with_raw_response.content(uploaded.id)
    assert response.headers["content-length"] == str(len(data)) and response.content == data
    assert reads == [(start, 100) for start in range(0, len(data), 100)]


def test_list_pages_with_after_and_order(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    ids = [client.files.create(file=(f"{i}.jsonl", jsonl([chat("a")])), purpose="batch").id for i in range(5)]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[:2:-1][:2] and first.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # the SDK follows `after` across pages
    assert [f.id for f in client.files.list(limit=3, order="asc")] == ids
    last = client.files.list(limit=2, after=ids[1])
    assert [f.id for f in last.data] == [ids[0]] and not last.has_more


def test_deleting_the_files_one_pages_through_reaches_them_all(api, tenant_key, openai_client):
    """The openai SDK's auto-paging asks for the next page after the last file of the page before, which the loop
    has deleted by then: its place in the list is kept, in either order, and for its tenant only."""
    key = tenant_key()
    client = openai_client(key)
    for order in ("desc", "asc"):
        ids = [client.files.create(file=(f"{i}.jsonl", jsonl([chat("a")])), purpose="batch").id for i in range(5)]
        deleted = []
        for file in client.files.list(limit=2, order=order):
            assert client.files.delete(file.id).deleted
            deleted.append(file.id)
        assert deleted == (ids[::-1] if order == "desc" else ids) and not client.files.list().data
    other = httpx.get(f"{api.url}/v1/files", params={"after": deleted[-1]},
                      headers={"Authorization": f"Bearer {tenant_key('other')}"})
    assert other.status_code == 400 and other.json()["error"]["param"] == "after"  # another tenant's is unknown


@pytest.mark.parametrize("params, param", [({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"),
                                           ({"limit": "many"}, "limit"), ({"order": "sideways"}, "order"),
                                           ({"after": "file-nope"}, "after")])
def test_bad_pagination_parameters_are_400(api, tenant_key, params, param):
    response = httpx.get(f"{api.url}/v1/files", params=params, headers={"Authorization": f"Bearer {tenant_key()}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


@pytest.mark.parametrize("data, purpose, status, code, words", [
    (b"a,b,c\n1,2,3\n", "batch", 400, "invalid_jsonl", "not JSONL"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "batch", 400, "invalid_jsonl", "not JSONL"),
    (b"[" * 5000 + b"\n", "batch", 400, "invalid_jsonl", "nested too deeply"),
    (b"", "batch", 400, "empty_file", "no requests"),
    (b"\n  \n", "batch", 400, "empty_file", "no requests"),
    (jsonl([chat("a")]), "fine-tune", 400, "invalid_value", "purpose 'fine-tune'"),
    (jsonl([chat(str(i)) for i in range(51)]), "batch", 400, "too_many_lines", "at most 50"),
    (b"x" * 100_001, "batch", 413, "file_too_large", "100000 bytes"),
    (b"x" * 400_000, "batch", 413, "file_too_large", "100000 bytes"),  # refused by Content-Length, unread
])
def test_refused_uploads_store_nothing(api, tenant_key, openai_client, data, purpose, status, code, words):
    client = openai_client(tenant_key())
    before = api.counts()
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("input.jsonl", data), purpose=purpose)
    assert refused.value.status_code == status
    assert refused.value.body["code"] == code and words in refused.value.body["message"]
    assert set(refused.value.body) == {"message", "type", "param", "code"}
    assert api.counts() == before


def chunked_upload(api, authorization: str | None) -> tuple[int, str, int]:
    """POST a 10 MB file in chunks, with no Content-Length, straight to the ASGI app: (status, error code, bytes the
    server read of the body)."""
    app = create_app(api.sessions, api.celery, TEST_SETTINGS)
    head = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: '
            b'form-data; name="file"; filename="in.jsonl"\r\n\r\n')
    chunks = [head, *[b"x" * 65_536] * 160, b"\r\n--B--\r\n"]  # 10 MB; the limit is 100 kB
    auth = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/files", "raw_path": b"/v1/files", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [*auth, (b"content-type", b"multipart/form-data; boundary=B"),
                         (b"transfer-encoding", b"chunked")]}
    read, sent = [], []

    async def receive() -> dict:
        read.append(chunks[len(read)])
        return {"type": "http.request", "body": read[-1], "more_body": len(read) < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]["code"], sum(map(len, read))


def test_an_upload_without_a_length_is_refused_as_it_passes_the_limit(api, tenant_key):
    """A chunked upload has no Content-Length to refuse it by: the server read and spooled all of it (2 GB in 6 s)
    before its route refused it; it stops reading once the body passes the limit."""
    status, code, read = chunked_upload(api, f"Bearer {tenant_key()}")
    assert (status, code) == (413, "file_too_large")
    assert read <= TEST_SETTINGS.max_file_bytes + MULTIPART_SLACK + 65_536
    assert api.count("files") == 0


@pytest.mark.parametrize("authorization, code", [(None, "missing_api_key"), ("Bearer sk-nobody", "invalid_api_key"),
                                                 ("Basic dXNlcg==", "missing_api_key")])
def test_an_upload_without_a_valid_key_is_refused_before_its_body_is_read(api, authorization, code):
    """FastAPI parses a form before the route's dependencies: the key was checked only once the whole upload (up
    to the size limit) had been spooled, so anyone could have the server spool files."""
    assert chunked_upload(api, authorization) == (401, code, 0)


def test_a_file_with_some_bad_lines_is_accepted(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat("a"), "{not json", "[1]"])), purpose="batch")
    assert uploaded.bytes > 0 and api.count("files") == 1


def test_missing_form_fields_are_named(api, tenant_key):
    headers = {"Authorization": f"Bearer {tenant_key()}"}
    response = httpx.post(f"{api.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat("a")]))}, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "purpose: required field is missing",
                                        "type": "invalid_request_error", "param": "purpose",
                                        "code": "missing_required_parameter"}
    response = httpx.post(f"{api.url}/v1/files", data={"purpose": "batch"}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert api.count("files") == 0


def test_unknown_file_ids_are_404(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as missing:
            call("file-doesnotexist")
        assert missing.value.body == {"message": "file file-doesnotexist not found", "type": "invalid_request_error",
                                      "param": None, "code": "not_found"}
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-out-batch_nope")


def test_file_ids_and_filters_no_row_can_have_are_refused(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    auth = {"Authorization": f"Bearer {client.api_key}"}
    for method, path in [("GET", "%00"), ("GET", "%00/content"), ("DELETE", "%00"), ("GET", "file-out-%00"),
                         ("GET", "file-err-%00/content"), ("DELETE", "file-out-%00")]:
        response = httpx.request(method, f"{api.url}/v1/files/{path}", headers=auth)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", (method, path)
    for param in ("after", "purpose"):
        response = httpx.get(f"{api.url}/v1/files", params={param: "a\x00"}, headers=auth)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert api.count("files") == 1


def test_an_upload_looks_its_key_up_once(api, tenant_key):
    """The upload guard authenticated the key before the body was read, and the route's dependency looked it up again:
    two queries of api_keys per upload. The dependency now reuses the caller the guard found for that same key."""
    from sqlalchemy import event

    lookups = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("SELECT") and "api_keys.key_hash =" in statement:  # not the write's hold of the key
            lookups.append(statement)

    headers = {"Authorization": f"Bearer {tenant_key('acme')}"}
    engine = api.sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", count)
    try:
        uploaded = httpx.post(f"{api.url}/v1/files", files={"file": ("in.jsonl", jsonl([chat("a")]))},
                              data={"purpose": "batch"}, headers=headers)
        assert uploaded.status_code == 200, uploaded.text
        assert len(lookups) == 1, lookups
        listed = httpx.get(f"{api.url}/v1/files", headers=headers).json()["data"]  # any other route: looked up, once
        assert [f["id"] for f in listed] == [uploaded.json()["id"]] and len(lookups) == 2
    finally:
        event.remove(engine, "before_cursor_execute", count)
