"""The sizes of a batch's output and error files, served with their metadata (GET /v1/files/{id}): counted while the
batch runs, kept by the first read once it has ended, and always the byte length of the download, non-ASCII text
included, whichever way the batch ended; on PostgreSQL and SQLite, through the API served by uvicorn."""

from __future__ import annotations

import httpx
import pytest
from servers import serve_app
from sqlalchemy import update
from store_test_utils import batch_row, chat, failed, jsonl, ok, submit
from test_leases import claim, run_together, write
from test_lifecycle import claim_and_die, expire_now

from sluice.api import store
from sluice.api.queue import make_app
from sluice.api.server import create_app
from sluice.api.settings import Settings
from sluice.api.store.recovery import MAX_ATTEMPTS
from sluice.api.tables import Batch

TEXT = "日本語の答え ✓ — naïve café 😀"  # three- and four-byte UTF-8: a count of characters would fall short


class Files:
    """A batch's output and error files through the API: their metadata and their downloads."""

    def __init__(self, url: str, key: str):
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}

    def size(self, file_id: str) -> int:
        response = httpx.get(f"{self.url}/v1/files/{file_id}", headers=self.headers)
        assert response.status_code == 200, response.text
        return response.json()["bytes"]

    def content(self, file_id: str) -> bytes:
        response = httpx.get(f"{self.url}/v1/files/{file_id}/content", headers=self.headers)
        assert response.status_code == 200, response.text
        return response.content

    def sizes_match(self, batch_id: str) -> tuple[int, int]:
        """Both files' metadata sizes, each checked against its download; returns the downloads' lengths."""
        lengths = []
        for file_id in (store.output_file_id(batch_id), store.error_file_id(batch_id)):
            length = len(self.content(file_id))
            assert self.size(file_id) == length, file_id
            lengths.append(length)
        return lengths[0], lengths[1]


@pytest.fixture
def files(sessions):
    with sessions.begin() as session:
        key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)[1]
    app = create_app(sessions, make_app("redis://127.0.0.1:1/0"), Settings())  # nothing here publishes
    with serve_app(app) as url:
        yield Files(url, key)


def kept(sessions, batch_id: str) -> tuple[int | None, int | None]:
    row = batch_row(sessions, batch_id)
    return row.output_bytes, row.error_bytes


def test_sizes_are_counted_while_running_then_kept_once_the_batch_completes(sessions, files):
    batch, work = submit(sessions, [chat("a", content=TEXT), "{bad", chat("b"), chat("ç", max_tokens=0), chat("c")])
    a, b, c = work.request_ids
    claim(sessions, work.request_ids, "w1")
    write(sessions, [ok(a, text=TEXT)], "w1")
    running = files.sizes_match(batch.id)
    assert kept(sessions, batch.id) == (None, None)  # a running batch's files still grow
    write(sessions, [ok(b, text=TEXT * 3)], "w1")
    assert files.sizes_match(batch.id)[0] > running[0]
    write(sessions, [failed(c, 5)], "w1")
    assert batch_row(sessions, batch.id).status == "completed" and kept(sessions, batch.id) == (None, None)
    final = files.sizes_match(batch.id)
    assert kept(sessions, batch.id) == final
    output = files.content(store.output_file_id(batch.id))
    assert TEXT in output.decode() and len(output) > len(output.decode())  # bytes, not characters
    with sessions.begin() as session:  # what is read from now on is the kept number, not a new count
        session.execute(update(Batch).where(Batch.id == batch.id).values(output_bytes=7))
    assert files.size(store.output_file_id(batch.id)) == 7


def test_an_expired_batch_keeps_the_size_of_its_expiry_error_lines_and_ignores_late_results(sessions, files):
    batch, work = submit(sessions, [chat("done"), chat("running", content=TEXT), chat("queued")])
    done, running, _ = work.request_ids
    claim(sessions, [done, running], "w1")
    write(sessions, [ok(done, text=TEXT)], "w1")
    assert expire_now(sessions, batch.id) == [batch.id]
    final = files.sizes_match(batch.id)
    assert final[1] > 0 and kept(sessions, batch.id) == final  # the batch_expired lines, written as it expired
    assert write(sessions, [ok(running, text=TEXT)], "w1") == []  # the worker's late result adds nothing
    assert files.sizes_match(batch.id) == final == kept(sessions, batch.id)


def test_a_cancelled_batch_keeps_its_sizes_once_its_running_requests_are_done(sessions, files):
    batch, work = submit(sessions, [chat("a"), chat("b"), chat("c")])
    a, b, _ = work.request_ids
    claim(sessions, [a, b], "w1")
    with sessions.begin() as session:
        assert store.cancel_batch(session, batch.id).status == "cancelling"
    write(sessions, [ok(a, text=TEXT)], "w1")  # still accepted: the batch waits for its running requests
    files.sizes_match(batch.id)
    assert kept(sessions, batch.id) == (None, None)
    write(sessions, [failed(b, 2)], "w1")
    assert batch_row(sessions, batch.id).status == "cancelled"
    final = files.sizes_match(batch.id)
    assert kept(sessions, batch.id) == final and final[0] > 0 and final[1] > 0
    assert write(sessions, [ok(b, text=TEXT)], "w1") == []
    assert files.sizes_match(batch.id) == final


def test_a_batch_that_ends_with_its_worker_lost_errors_keeps_them(sessions, files):
    batch, work = submit(sessions, [chat("poison"), chat("fine")])
    poison, fine = work.request_ids
    for attempt in range(1, MAX_ATTEMPTS + 1):
        claim_and_die(sessions, [poison], f"victim-{attempt}")
        with sessions.begin() as session:
            store.recover_expired_leases(session)
    claim(sessions, [fine], "w1")
    write(sessions, [ok(fine, text=TEXT)], "w1")
    assert batch_row(sessions, batch.id).status == "completed"
    final = files.sizes_match(batch.id)
    assert kept(sessions, batch.id) == final and final[1] > 0


def test_a_failed_batch_keeps_empty_files(sessions, files):
    batch, _ = submit(sessions, b"")
    assert batch.status == "failed"
    assert files.sizes_match(batch.id) == (0, 0) == kept(sessions, batch.id)


def test_the_first_size_kept_is_the_one_every_host_reads(sessions):
    """Two hosts that counted at once both keep theirs by a conditional UPDATE: one wins, and both answer its number
    (they counted the same final file, so the numbers agree anyway; unequal ones show who won)."""
    from sluice.api.store.views import keep_file_bytes

    batch, work = submit(sessions, jsonl([chat("a")]))
    with sessions.begin() as session:
        row = store.get_batch(session, batch.id)
        assert keep_file_bytes(session, row, "output", 10) == 10  # running: nothing kept
    write(sessions, [ok(work.request_ids[0])], "w1")
    with sessions.begin() as session:
        ended = store.get_batch(session, batch.id)

    def keep(size):
        with sessions.begin() as session:
            return keep_file_bytes(session, ended, "output", size)

    first, second = run_together(lambda: keep(100), lambda: keep(200))
    assert first == second == kept(sessions, batch.id)[0] and first in (100, 200)
    assert keep(300) == first and kept(sessions, batch.id)[1] is None
