"""/v1/requests: one body, an id at once, its chunk published, polled until its result is written."""

from __future__ import annotations

import json

import httpx
import pytest
from api_helpers import chat, finish
from sqlalchemy import select

from sluice.api.queue import model_queue, queue_depth
from sluice.api.tables import Request


def test_a_single_request_is_queued_published_and_answered(api, tenant_key):
    auth = {"Authorization": f"Bearer {tenant_key()}"}
    body = chat("x", content="Hi", max_tokens=5)["body"]
    created = httpx.post(f"{api.url}/v1/requests", headers=auth, json={"endpoint": "/v1/chat/completions",
                                                                       "body": body}).json()
    assert created["id"].startswith("req_") and created["status"] == "queued" and created["model"] == "tiny"
    assert created["response"] is None and created["usage"] is None
    assert queue_depth(api.celery, model_queue("tiny")) == 1
    with api.sessions.begin() as session:
        [request_id] = session.scalars(select(Request.id).where(Request.batch_id == created["id"])).all()
    finish(api.sessions, [request_id], {request_id: "Hello!"})
    done = httpx.get(f"{api.url}/v1/requests/{created['id']}", headers=auth).json()
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    assert done["response"]["choices"][0]["message"]["content"] == "Hello!"
    assert done["usage"]["total_tokens"] == 7 and done["error"] is None


@pytest.mark.parametrize("payload, status, param, words", [
    ({"endpoint": "/v1/chat/completions", "body": {"model": "tiny", "messages": []}}, 400, "body.messages",
     "at least 1"),
    ({"endpoint": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}, 400,
     "body.model", "required"),
    ({"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "x", "n": 129}}, 400, "body.n",
     "less than or equal to 128"),
    ({"endpoint": "/v1/embeddings", "body": {"model": "tiny", "input": "x"}}, 400, "endpoint", "not supported"),
    ({"endpoint": "/v1/completions", "body": {"model": "huge", "prompt": "x"}}, 404, "body.model", "not served"),
    ({"endpoint": "/v1/completions"}, 400, "body", "required"),
])
def test_bad_requests_store_nothing(api, tenant_key, payload, status, param, words):
    auth = {"Authorization": f"Bearer {tenant_key()}"}
    before = api.counts()
    response = httpx.post(f"{api.url}/v1/requests", headers=auth, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert api.counts() == before and api.redis.dbsize() == 0


def test_unknown_request_is_404(api, tenant_key):
    auth = {"Authorization": f"Bearer {tenant_key()}"}
    assert httpx.get(f"{api.url}/v1/requests/req_nope", headers=auth).status_code == 404


@pytest.mark.parametrize("body, code, param", [
    ({"model": "tiny", "prompt": "x", "colour": "red"}, "unknown_parameter", "body.colour"),
    ({"prompt": "x"}, "missing_required_parameter", "body.model"),
    ({"model": "tiny", "prompt": "x", "n": 0}, "invalid_value", "body.n"),
    ({"model": "\ud800", "prompt": "x"}, "invalid_value", None),
    ({"model": "tiny", "prompt": "\ud83d"}, "invalid_value", None),
])
def test_a_bad_body_has_the_error_code_its_batch_line_would(api, tenant_key, body, code, param):
    auth = {"Authorization": f"Bearer {tenant_key()}", "content-type": "application/json"}
    before = api.counts()
    # json.dumps writes a lone surrogate as its escape, which httpx's own encoding (UTF-8) cannot hold
    response = httpx.post(f"{api.url}/v1/requests", content=json.dumps({"endpoint": "/v1/completions", "body": body}),
                          headers=auth)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param) and not error["message"].startswith("line")
    assert api.counts() == before and api.redis.dbsize() == 0
