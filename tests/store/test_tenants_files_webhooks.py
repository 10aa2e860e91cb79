"""Tenants and keys (hashes only, revocable), stored files, webhook endpoints."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from sluice.api import store
from sluice.api.tables import ApiKey, File, FileContent


def test_keys_are_shown_once_stored_hashed_and_revocable(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        assert store.get_or_create_tenant(session, "acme").id == tenant.id
        row, key = store.create_api_key(session, tenant.id)
        stored = session.scalars(select(ApiKey)).one()
        assert key.startswith("sk-sluice-") and key.startswith(row.prefix) and len(row.prefix) == 14
        assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest() and key not in stored.key_hash
        assert store.resolve_api_key(session, key)[0].name == "acme"
        assert store.resolve_api_key(session, key + "x") is None
        store.revoke_api_key(session, row.id)
        store.revoke_api_key(session, row.id)  # again: still revoked, no error
        assert store.resolve_api_key(session, key) is None
        with pytest.raises(store.NotFound):
            store.revoke_api_key(session, "key_nope")
        with pytest.raises(store.NotFound):
            store.create_api_key(session, tenant.id + 100)


@pytest.mark.parametrize("name", ["", "a b", "-x", "x" * 65, "name/with/slash"])
def test_bad_tenant_names_are_refused(sessions, name):
    with sessions.begin() as session:
        with pytest.raises(store.InvalidInput, match="tenant name"):
            store.get_or_create_tenant(session, name)


def test_files_store_content_apart_and_refuse_bad_uploads(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        file = store.store_file(session, tenant.id, "in.jsonl", "batch", b"{}\n")
        assert file.id.startswith("file-") and (file.bytes, file.status, file.purpose) == (3, "processed", "batch")
        assert store.file_content(session, file.id) == b"{}\n"
        with pytest.raises(store.InvalidInput, match="purpose 'fine-tune'"):
            store.store_file(session, tenant.id, "in.jsonl", "fine-tune", b"{}")
        with pytest.raises(store.InvalidInput, match="has 11 bytes; the limit is 10"):
            store.store_file(session, tenant.id, "in.jsonl", "batch", b"x" * 11, max_bytes=10)
        with pytest.raises(store.InvalidInput, match="name"):
            store.store_file(session, tenant.id, "", "batch", b"{}")
        with pytest.raises(store.NotFound):
            store.get_file(session, file.id, tenant_id=tenant.id + 1)
        assert len(session.scalars(select(File)).all()) == len(session.scalars(select(FileContent)).all()) == 1


def test_webhook_endpoints(sessions):
    with sessions.begin() as session:
        tenant = store.get_or_create_tenant(session, "acme")
        endpoint = store.create_webhook_endpoint(session, tenant.id, "https://example.com/hook")
        assert endpoint.secret.startswith("whsec_") and endpoint.events == list(store.EVENTS)
        assert endpoint.id.startswith("we_")
        with pytest.raises(store.InvalidInput, match="batch.done"):
            store.create_webhook_endpoint(session, tenant.id, "https://example.com/hook", ["batch.done"])
        with pytest.raises(store.InvalidInput, match="url"):
            store.create_webhook_endpoint(session, tenant.id, "ftp://example.com/hook")


def test_a_files_slices_join_into_its_bytes(sessions):
    data = bytes(range(256)) * 40 + "é\x00\n".encode()  # every byte value, a NUL and a multi-byte character
    with sessions.begin() as session:
        file = store.store_file(session, store.get_or_create_tenant(session, "acme").id, "in.jsonl", "batch", data)
        slices = [store.file_slice(session, file.id, start, 1000) for start in range(0, len(data), 1000)]
        assert all(len(s) == 1000 for s in slices[:-1]) and b"".join(slices) == data
        assert store.file_slice(session, file.id, len(data), 1000) == b""
        assert store.file_slice(session, "file-gone", 0, 1000) == b""
