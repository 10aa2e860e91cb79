"""Health, readiness, Prometheus metrics, the OpenAPI document, and the same API on SQLite."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
from api_helpers import TEST_SETTINGS, chat, finish, jsonl, request_ids
from servers import serve_app

from sluice.api import db, store
from sluice.api.queue import make_app
from sluice.api.server import create_app
from sluice.api.settings import Settings
from sluice.api.tables import EfficiencyWindow

METRICS = ("sluice:num_requests_running", "sluice:num_requests_waiting", "sluice:kv_cache_usage_perc",
           "sluice:prompt_tokens_total", "sluice:generation_tokens_total", "sluice:time_to_first_token_seconds",
           "sluice:e2e_request_latency_seconds", "sluice:queue_depth")
SLUICE = [sys.executable, "-m", "sluice"]  # the `sluice` command


def test_health_and_readiness(api, api_database):
    assert httpx.get(f"{api.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{api.url}/readyz").json() == {"status": "ok"}
    engine = db.make_engine(api_database)
    down = create_app(db.session_factory(engine), make_app("redis://127.0.0.1:1/0"), TEST_SETTINGS)
    with serve_app(down) as url:
        response = httpx.get(f"{url}/readyz", timeout=30)
        assert response.status_code == 503 and "broker" in response.json() and "database" not in response.json()
        assert httpx.get(f"{url}/healthz").status_code == 200
    engine.dispose()


def test_sluice_api_serves_from_the_environment(tmp_path, api_broker):
    database = f"sqlite:///{tmp_path / 'sluice.db'}"
    db.upgrade(db.make_engine(database))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "SLUICE_DATABASE_URL": database, "SLUICE_BROKER_URL": api_broker[0]}
    server = subprocess.Popen([*SLUICE, "api", "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/readyz").json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert server.poll() is None and time.time() < deadline, server.stdout.read().decode()
                time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/files").status_code == 401
    finally:
        server.terminate()
        server.wait(timeout=30)
    bad = subprocess.run([*SLUICE, "api"], env={**env, "SLUICE_MAX_FILE_BYTES": "lots"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "SLUICE_MAX_FILE_BYTES='lots'" in bad.stderr


def test_metrics_are_computed_from_the_database_and_redis(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    file = client.files.create(file=("in.jsonl", jsonl([chat("a"), chat("b"), chat("c")])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    ids = request_ids(api.sessions, batch.id)
    finish(api.sessions, [ids["a"]])
    with api.sessions.begin() as session:
        store.claim(session, [ids["b"]], "w1", 60)
        store.heartbeat(session, "w1", hostname="h", pid=1, model="/m", served_model_name="tiny")
        store.record_efficiency(session, EfficiencyWindow(
            worker_id="w1", model="tiny", window_start=1.0, window_end=2.0, steps=1, prefill_tokens=1,
            decode_tokens=1, mean_running_seqs=1.0, max_running_seqs=1, max_num_seqs=4, token_budget_use=0.1,
            kv_cache_use=0.375, preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, busy_seconds=1.0,
            idle_seconds=0.0))
    text = httpx.get(f"{api.url}/metrics").text
    assert all(f"# TYPE {name.removesuffix('_total')}" in text for name in METRICS), text
    for sample in ('sluice:num_requests_running{model="tiny"} 1.0', 'sluice:num_requests_waiting{model="tiny"} 1.0',
                   'sluice:kv_cache_usage_perc{model="tiny",worker="w1"} 0.375',
                   'sluice:prompt_tokens_total{model="tiny"} 5.0', 'sluice:generation_tokens_total{model="tiny"} 2.0',
                   'sluice:time_to_first_token_seconds_bucket{le="0.05",model="tiny"} 1.0',
                   'sluice:time_to_first_token_seconds_bucket{le="0.025",model="tiny"} 0.0',
                   'sluice:e2e_request_latency_seconds_count{model="tiny"} 1.0',
                   'sluice:queue_depth{model="tiny"} 1.0'):
        assert sample in text, sample


def test_metrics_leave_out_a_batch_whose_every_line_failed_validation(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    failed = client.files.create(file=("bad.jsonl", jsonl([chat("a", temperature=9), chat("b", model=None)])),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=failed.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "completed" and batch.request_counts.failed == 2  # no line ran: the batch has no model
    good = client.files.create(file=("in.jsonl", jsonl([chat("c")])), purpose="batch")
    finish(api.sessions, list(request_ids(api.sessions, client.batches.create(
        input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h").id).values()))
    text = httpx.get(f"{api.url}/metrics").text
    assert 'model=""' not in text, text
    for sample in ('sluice:prompt_tokens_total{model="tiny"} 5.0', 'sluice:generation_tokens_total{model="tiny"} 2.0',
                   'sluice:e2e_request_latency_seconds_count{model="tiny"} 1.0'):
        assert sample in text, sample


def test_metrics_token_when_configured(api):
    secured = create_app(api.sessions, api.celery, Settings(metrics_token="scrape-me"))
    with serve_app(secured) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        response = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert response.status_code == 200 and "sluice:queue_depth" in response.text


ROUTES = {("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"),
          ("GET", "/v1/files/{file_id}/content"), ("DELETE", "/v1/files/{file_id}"), ("POST", "/v1/batches"),
          ("GET", "/v1/batches"), ("GET", "/v1/batches/{batch_id}"), ("POST", "/v1/batches/{batch_id}/cancel"),
          ("GET", "/v1/batches/{batch_id}/results"), ("GET", "/v1/batches/{batch_id}/efficiency"),
          ("POST", "/v1/requests"), ("GET", "/v1/requests/{request_id}"), ("GET", "/v1/usage"),
          ("POST", "/v1/webhook_endpoints"), ("GET", "/v1/webhook_endpoints"),
          ("GET", "/v1/webhook_endpoints/{endpoint_id}"), ("DELETE", "/v1/webhook_endpoints/{endpoint_id}"),
          ("GET", "/v1/webhook_endpoints/{endpoint_id}/deliveries"), ("GET", "/v1/models"),
          ("GET", "/v1/models/{model}"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}


def test_openapi_documents_every_route_with_the_bearer_scheme(api, tenant_key):
    doc = httpx.get(f"{api.url}/openapi.json").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": "an API key from `sluice keys create --tenant NAME`"}
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == ROUTES
    auth = {"Authorization": f"Bearer {tenant_key()}"}
    for method, path in documented:  # each is served: an answer from its handler, not the router's 404 or 405
        response = httpx.request(method, api.url + path.replace("{", "x").replace("}", ""), headers=auth)
        assert response.status_code < 500, (method, path)
        if response.status_code >= 400:
            assert response.json()["error"]["code"] not in ("unknown_url", "method_not_allowed"), (method, path)
    assert httpx.get(f"{api.url}/v1/nowhere", headers=auth).json()["error"]["code"] == "unknown_url"
    for path, ops in doc["paths"].items():
        for operation in ops.values():
            if path.startswith("/v1/"):
                assert operation["security"] == [{"HTTPBearer": []}], path
                assert "422" not in operation["responses"] and "400" in operation["responses"]
            elif path == "/metrics":
                assert operation["security"] == [{}, {"HTTPBearer": []}]
            else:
                assert "security" not in operation
    upload = doc["paths"]["/v1/files"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"] and "413" in upload["responses"]


def test_the_same_api_on_sqlite(tmp_path, api, openai_client):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'sluice.db'}")
    db.upgrade(engine)
    sessions = db.session_factory(engine)
    with sessions.begin() as session:
        key = store.create_api_key(session, store.get_or_create_tenant(session, "solo").id)[1]
    with serve_app(create_app(sessions, api.celery, TEST_SETTINGS)) as url:
        client = openai_client(key)
        client.base_url = f"{url}/v1"
        file = client.files.create(file=("in.jsonl", jsonl([chat(str(i)) for i in range(30)])), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        finish(sessions, list(request_ids(sessions, batch.id).values()))
        done = client.batches.retrieve(batch.id)
        lines = client.files.content(done.output_file_id).text.splitlines()
        assert done.status == "completed" and [json.loads(line)["custom_id"] for line in lines] == [
            str(i) for i in range(30)]
    engine.dispose()
