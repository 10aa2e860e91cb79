"""Keys and tenants: every /v1 route needs a live key; another tenant's ids are not found, its lists are empty."""

from __future__ import annotations

import threading

import httpx
import pytest
from api_helpers import chat, finish, jsonl, request_ids
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from sluice.api.tables import ApiKey
from sluice.worker.cli import main


@pytest.fixture
def owned(api, tenant_key, openai_client, monkeypatch):
    """Tenant acme's file, batch (with a result), single request and webhook endpoint."""
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW_PRIVATE", "1")
    key = tenant_key("acme")
    client = openai_client(key)
    file = client.files.create(file=("in.jsonl", jsonl([chat("a"), "{bad"])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    finish(api.sessions, list(request_ids(api.sessions, batch.id).values()))
    headers = {"Authorization": f"Bearer {key}"}
    request = httpx.post(f"{api.url}/v1/requests", headers=headers, json={
        "endpoint": "/v1/chat/completions", "body": chat("x")["body"]}).json()
    endpoint = httpx.post(f"{api.url}/v1/webhook_endpoints", headers=headers,
                          json={"url": "http://127.0.0.1:9/hook"}).json()
    return {"file": file.id, "batch": batch.id, "request": request["id"], "endpoint": endpoint["id"], "key": key}


def routes(ids: dict) -> list[tuple[str, str]]:
    file, batch = ids["file"], ids["batch"]
    return [("GET", f"/v1/files/{file}"), ("GET", f"/v1/files/{file}/content"), ("DELETE", f"/v1/files/{file}"),
            ("GET", f"/v1/files/file-out-{batch}"), ("GET", f"/v1/files/file-out-{batch}/content"),
            ("GET", f"/v1/files/file-err-{batch}/content"), ("DELETE", f"/v1/files/file-err-{batch}"),
            ("GET", f"/v1/batches/{batch}"), ("POST", f"/v1/batches/{batch}/cancel"),
            ("GET", f"/v1/batches/{batch}/results"), ("GET", f"/v1/batches/{batch}/efficiency"),
            ("GET", f"/v1/requests/{ids['request']}"), ("GET", f"/v1/webhook_endpoints/{ids['endpoint']}"),
            ("DELETE", f"/v1/webhook_endpoints/{ids['endpoint']}"),
            ("GET", f"/v1/webhook_endpoints/{ids['endpoint']}/deliveries")]


def test_another_tenants_ids_are_not_found_and_its_lists_are_empty(api, tenant_key, owned):
    other = {"Authorization": f"Bearer {tenant_key('globex')}"}
    for method, path in routes(owned):
        response = httpx.request(method, api.url + path, headers=other)
        assert response.status_code == 404, (method, path, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    for path in ("/v1/files", "/v1/batches", "/v1/webhook_endpoints"):
        assert httpx.get(api.url + path, headers=other).json()["data"] == []
    assert httpx.get(f"{api.url}/v1/usage", headers=other).json()["data"] == []
    response = httpx.post(f"{api.url}/v1/batches", headers=other, json={
        "input_file_id": owned["file"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert response.status_code == 404
    mine = {"Authorization": f"Bearer {owned['key']}"}
    for method, path in routes(owned):  # still there for their owner
        if method == "GET":
            assert httpx.get(api.url + path, headers=mine).status_code == 200, path


def test_single_requests_are_not_batches(api, owned):
    mine = {"Authorization": f"Bearer {owned['key']}"}
    assert httpx.get(f"{api.url}/v1/batches/{owned['request']}", headers=mine).status_code == 404
    assert httpx.get(f"{api.url}/v1/requests/{owned['batch']}", headers=mine).status_code == 404
    assert [b["id"] for b in httpx.get(f"{api.url}/v1/batches", headers=mine).json()["data"]] == [owned["batch"]]


@pytest.mark.parametrize("header, code", [(None, "missing_api_key"), ("Basic dXNlcjpwYXNz", "missing_api_key"),
                                          ("Bearer sk-sluice-unknown", "invalid_api_key")])
def test_every_v1_route_needs_a_key(api, owned, header, code):
    headers = {"Authorization": header} if header else {}
    for method, path in [*routes(owned), ("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                         ("POST", "/v1/batches"), ("POST", "/v1/requests"), ("GET", "/v1/usage"),
                         ("GET", "/v1/webhook_endpoints"), ("POST", "/v1/webhook_endpoints")]:
        response = httpx.request(method, api.url + path, headers=headers)
        assert response.status_code == 401, (method, path)
        assert response.json()["error"]["code"] == code and response.headers["www-authenticate"] == "Bearer"


def test_keys_cli_creates_and_revokes(api, api_database, openai_client, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_DATABASE_URL", api_database)
    assert main(["keys", "create", "--tenant", "team-a"]) == 0
    out, err = capsys.readouterr()
    key = out.splitlines()[-1]
    assert key.startswith("sk-sluice-") and "shown only now" in err
    client = openai_client(key)
    assert list(client.files.list()) == []
    prefix = err.split("(prefix ")[1].split(")")[0]
    assert main(["keys", "revoke", prefix]) == 0
    response = httpx.get(f"{api.url}/v1/files", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert key not in response.text
    assert main(["keys", "revoke", "key_nope"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["keys", "create", "--tenant", "bad name"]) == 2


def test_a_key_revoked_while_its_upload_arrives_stores_nothing(api, tenant_key, monkeypatch):
    """The key is checked before an upload's body is read, and the body may take minutes: a revoke in between wins."""
    from sluice.api import store

    key, checked, resolve = tenant_key(), threading.Event(), store.resolve_api_key
    monkeypatch.setattr(store, "resolve_api_key", lambda *a: (resolve(*a), checked.set())[0])
    body, boundary = jsonl([chat("a")]), "sluiceboundary"
    parts = [f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n".encode(),
             f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
             "Content-Type: application/jsonl\r\n\r\n".encode(), body, f"\r\n--{boundary}--\r\n".encode()]

    def upload():  # the key is revoked once the server has taken the body's first part
        yield parts[0]
        assert checked.wait(10)  # the server (in this process) has checked the key
        with api.sessions.begin() as session:
            row = session.scalars(select(ApiKey).where(ApiKey.prefix == key[:14])).one()
            assert store.revoke_api_key(session, row.id) is None
        yield from parts[1:]

    before = api.counts()
    answer = httpx.post(f"{api.url}/v1/files", content=upload(), timeout=30,
                        headers={"Authorization": f"Bearer {key}",
                                 "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text
    assert "was revoked while this request ran" in answer.json()["error"]["message"]
    assert api.counts() == before


def test_a_write_in_a_keys_name_holds_the_key_until_it_commits(api, tenant_key):
    """A revoke waits for a create that has checked the key (PostgreSQL row lock), so no create lands after it."""
    from sqlalchemy import text

    from sluice.api import store

    tenant_key()
    with api.sessions.begin() as session:
        key_id = session.scalars(select(ApiKey.id)).one()
    with api.sessions.begin() as holder:
        assert store.hold_live_key(holder, key_id)
        with api.sessions.begin() as revoker:
            revoker.execute(text("SET LOCAL lock_timeout = '200ms'"))
            with pytest.raises(OperationalError, match="lock timeout"):
                store.revoke_api_key(revoker, key_id)
    with api.sessions.begin() as revoker:
        assert store.revoke_api_key(revoker, key_id) is None
    with api.sessions.begin() as session:
        assert not store.hold_live_key(session, key_id)
