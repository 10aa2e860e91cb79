"""Flows as users drive them with the official openai SDK (sync and async, its default retries included), against
the live server: each test reproduces a defect found that way, and fails without its fix."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from api_helpers import chat, finish, jsonl, request_ids


def counting_client(url: str, key: str, sent: list[str]) -> openai.OpenAI:
    """An SDK client with its default retries, recording every request it sends."""
    hooks = {"request": [lambda request: sent.append(f"{request.method} {request.url.path}")]}
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=httpx.Client(event_hooks=hooks))


def completed_batch(api, client) -> openai.types.Batch:
    file = client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    finish(api.sessions, list(request_ids(api.sessions, batch.id).values()))
    return client.batches.retrieve(batch.id)


def test_a_conflict_is_answered_once_not_retried_by_the_sdk(api, tenant_key, openai_client):
    """The SDK retries a 409 (as a lock timeout) twice, with backoff, unless told not to: cancelling a completed
    batch sent three requests and took over a second before it raised."""
    key = tenant_key()
    batch = completed_batch(api, openai_client(key))
    sent: list[str] = []
    with pytest.raises(openai.ConflictError) as refused:
        counting_client(api.url, key, sent).batches.cancel(batch.id)
    assert sent == [f"POST /v1/batches/{batch.id}/cancel"]
    assert refused.value.response.headers["x-should-retry"] == "false" and refused.value.code == "conflict"

    async def cancel_async() -> None:
        async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key=key) as client:
            with pytest.raises(openai.ConflictError):
                await client.with_options(timeout=5).batches.cancel(batch.id)
    asyncio.run(asyncio.wait_for(cancel_async(), 1.0))  # retried, it takes 1-3 s


def test_a_batch_of_a_batch_output_file_names_its_purpose(api, tenant_key, openai_client):
    """A batch's output file is retrievable (purpose batch_output), so a batch made of it was a confusing 404
    'file ... not found'; it is a 400 on input_file_id, as for any file whose purpose is not batch."""
    client = openai_client(tenant_key())
    batch = completed_batch(api, client)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    before = api.counts()
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert (refused.value.param, refused.value.code) == ("input_file_id", "invalid_value")
    assert "batch_output" in refused.value.body["message"] and api.counts() == before
    stranger = openai_client(tenant_key("other"))
    with pytest.raises(openai.NotFoundError) as missing:  # another tenant's batch: not found, as its files are
        stranger.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    assert missing.value.body["message"] == f"file {batch.output_file_id} not found"


def test_a_file_id_of_no_batch_is_a_file_not_found(api, tenant_key, openai_client):
    """An output or error file id naming no batch of the caller's answered 'batch ... not found' to a file call."""
    client = openai_client(tenant_key())
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        for file_id in ("file-err-batch_nope", "file-out-req_nope"):
            with pytest.raises(openai.NotFoundError) as missing:
                call(file_id)
            assert missing.value.body["message"] == f"file {file_id} not found"


def test_a_base_url_without_v1_is_told_where_the_api_is(api, tenant_key):
    """OpenAI(base_url="http://host:port") (no /v1) is the usual slip; a bare 404 'Not Found' did not say why."""
    client = openai.OpenAI(base_url=api.url, api_key=tenant_key(), max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.list()
    assert missing.value.code == "unknown_url"
    assert "GET /files" in missing.value.message and "/v1" in missing.value.message


def test_a_wrong_method_names_the_allowed_ones(api, tenant_key, openai_client):
    client = openai_client(tenant_key())
    with pytest.raises(openai.APIStatusError) as refused:
        client.put("/files", cast_to=httpx.Response)
    assert refused.value.status_code == 405 and refused.value.code == "method_not_allowed"
    assert "PUT /v1/files" in refused.value.message and "GET, POST" in refused.value.message


@pytest.mark.parametrize("filename, disposition", [
    ("in.jsonl", 'attachment; filename="in.jsonl"'),
    ("données ü.jsonl", "attachment; filename*=utf-8''donn%C3%A9es%20%C3%BC.jsonl"),
])
def test_a_download_names_its_file(api, tenant_key, openai_client, filename, disposition):
    """with_raw_response/with_streaming_response (and browsers, curl -OJ) had no name to save a download under."""
    client = openai_client(tenant_key())
    batch = completed_batch(api, client)
    file_id = client.files.create(file=(filename, jsonl([chat("a")])), purpose="batch").id
    assert client.files.with_raw_response.content(file_id).headers["content-disposition"] == disposition
    with client.files.with_streaming_response.content(batch.output_file_id) as response:
        assert response.headers["content-disposition"] == f'attachment; filename="{batch.id}_output.jsonl"'
        assert response.headers["content-type"] == "application/octet-stream"


def test_expiry_settings_are_refused_not_ignored(api, tenant_key, openai_client):
    """files.create(expires_after=...) was accepted and ignored (the file kept past it), while batches.create's
    output_expires_after was an unknown parameter: both are documented fields sluice does not honour."""
    client = openai_client(tenant_key())
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert refused.value.code == "unsupported_value" and refused.value.param == "expires_after"
    assert not client.files.list().data
    file = client.files.create(file=("in.jsonl", jsonl([chat("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 3600})
    assert refused.value.code == "unsupported_value" and refused.value.param == "output_expires_after"
    assert not client.batches.list().data
