"""A Python client for sluice's REST API, without torch: submit batches, wait for them with a progress bar, iterate
results as they finish, cancel, and run a prompt template over many documents.

    client = Client("http://localhost:8000", api_key)
    batch = client.submit([{"model": "llama", "messages": [{"role": "user", "content": "Hi"}]}])
    for result in client.results(batch["id"]):   # output and error lines, as each request finishes
        ...

Idempotent calls (GET, DELETE) are retried with exponential backoff after a 429 or 5xx answer and after a connection
that fails. A POST (upload, create, cancel) is retried only where the server cannot have acted on it: a 429 or 503
answer (refused before any work), or a connection never made (ConnectError, ConnectTimeout, PoolTimeout: nothing was
sent). After a timeout or another 5xx the server may have done the work (created the batch) all the same, so the
POST is not sent again: it raises SluiceError saying so, and the caller checks before trying again. Retry-After (in
seconds, decimals too, or an HTTP date) is honoured, up to MAX_WAIT. Any other error raises SluiceError carrying the
server's message, param and code.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Iterator
from datetime import timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
TERMINAL = ("completed", "failed", "expired", "cancelled")
PAGE = 1000
MAX_WAIT = 60.0  # the longest wait between tries: a Retry-After of a day should not hang the caller for one
IDEMPOTENT = ("GET", "HEAD", "OPTIONS", "PUT", "DELETE")  # RFC 9110: sending these twice does no more than once
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # raised before any byte left the client
REFUSED = (429, 503)  # the server turned the request away before doing any of its work


class SluiceError(Exception):
    """The server refused a request (or kept failing): its status code and OpenAI-shaped error fields."""

    def __init__(self, status: int | None, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"{message} (HTTP {status}{', ' + code if code else ''})" if status else message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_response(cls, response: httpx.Response) -> SluiceError:
        try:
            error = response.json()["error"]
            return cls(response.status_code, error["message"], error.get("param"), error.get("code"))
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, response.text[:500] or response.reason_phrase)


class Client:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 60.0, max_retries: int = 5,
                 backoff: float = 0.5, poll_interval: float = 2.0, transport: httpx.BaseTransport | None = None):
        """`base_url` is the server's address, with or without the /v1 that the openai SDK's base_url ends with."""
        root = base_url.rstrip("/").removesuffix("/v1")
        if httpx.URL(root).scheme not in ("http", "https"):  # else every call fails, retried, as if sent
            raise ValueError(f"base_url {base_url!r}: give the server's address with its scheme, as in "
                             "'http://localhost:8000'")
        self.http = httpx.Client(base_url=root + "/v1", headers={"Authorization": f"Bearer {api_key}"},
                                 timeout=timeout, transport=transport)
        self.max_retries, self.backoff, self.poll_interval = max_retries, backoff, poll_interval

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def upload(self, data: bytes, filename: str = "batch.jsonl") -> dict:
        return self._request("POST", "/files", files={"file": (filename, data)}, data={"purpose": "batch"}).json()

    def submit(self, requests: list[dict] | str | Path, *, endpoint: str | None = None,
               metadata: dict[str, str] | None = None, completion_window: str = "24h") -> dict:
        """Create a batch from request bodies (custom_id "0", "1", ... in list order; chat if they have messages,
        else completions) or from a JSONL file of batch lines (endpoint: its first line's url). Returns the batch.
        A create that timed out or failed with a 5xx is not sent again (it may have made the batch): it raises."""
        if isinstance(requests, str | Path):
            data, filename = Path(requests).read_bytes(), Path(requests).name
            endpoint = endpoint or _first_url(data)
        else:
            endpoint = endpoint or (CHAT_URL if requests and "messages" in requests[0] else COMPLETIONS_URL)
            data, filename = _jsonl({str(i): body for i, body in enumerate(requests)}, endpoint), "batch.jsonl"
        file = self.upload(data, filename)
        return self._request("POST", "/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                                       "completion_window": completion_window,
                                                       "metadata": metadata}).json()

    def batch(self, batch_id: str) -> dict:
        return self._request("GET", f"/batches/{batch_id}").json()

    def cancel(self, batch_id: str) -> dict:
        return self._request("POST", f"/batches/{batch_id}/cancel").json()

    def wait(self, batch_id: str, *, progress: bool = True, timeout: float | None = None) -> dict:
        """Poll until the batch ends (completed, failed, expired or cancelled), with a progress bar on stderr."""
        deadline = None if timeout is None else time.monotonic() + timeout
        batch = self.batch(batch_id)
        with tqdm(total=batch["request_counts"]["total"], desc=batch_id, unit="req", file=sys.stderr,
                  disable=not progress) as bar:
            while True:
                counts = batch["request_counts"]
                bar.total = counts["total"]
                bar.update(counts["completed"] + counts["failed"] - bar.n)
                bar.set_postfix(status=batch["status"], failed=counts["failed"])
                if batch["status"] in TERMINAL:
                    return batch
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {batch_id} is still {batch['status']} after {timeout} s")
                time.sleep(self.poll_interval)
                batch = self.batch(batch_id)

    def results(self, batch_id: str) -> Iterator[dict]:
        """Each result (an output or error line, with its input `line` and `finished_at`) once, as it finishes,
        until the batch ends. A result committed late can land before the cursor; if the count comes up short at
        the end, the pages are read again from the start for what was missed."""
        seen: set[int] = set()
        after = None
        while True:
            batch = self.batch(batch_id)  # before the pages: read after the batch ended, they hold every result
            for result in self._pages(batch_id, after):
                after = result["line"]
                if result["line"] not in seen:
                    seen.add(result["line"])
                    yield result
            if batch["status"] in TERMINAL:
                counts = batch["request_counts"]
                if len(seen) < counts["completed"] + counts["failed"]:
                    for result in self._pages(batch_id, None):
                        if result["line"] not in seen:
                            seen.add(result["line"])
                            yield result
                return
            time.sleep(self.poll_interval)

    def map_documents(self, template: str, documents: dict[str, str], *, model: str, endpoint: str = CHAT_URL,
                      progress: bool = True, **body: Any) -> dict[str, dict]:
        """Run `template` over each document as one batch and wait: {document id: its output or error line}.

        "{text}" and "{id}" in the template are replaced by each document's text and id (other braces are left
        alone, so templates may show JSON); `body` adds fields to every request (max_tokens, temperature, ...)."""
        bodies = {}
        for doc_id, text in documents.items():
            prompt = template.replace("{id}", doc_id).replace("{text}", text)
            content = {"messages": [{"role": "user", "content": prompt}]} if endpoint == CHAT_URL else {
                "prompt": prompt}
            bodies[doc_id] = {"model": model, **content, **body}
        file = self.upload(_jsonl(bodies, endpoint), "documents.jsonl")
        batch = self._request("POST", "/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                                        "completion_window": "24h"}).json()
        self.wait(batch["id"], progress=progress)
        # by line, not custom_id: the error line of an id the server refused (empty, not valid Unicode) has none
        doc_ids = list(bodies)
        return {doc_ids[result["line"] - 1]: result for result in self._pages(batch["id"], None)}

    def _pages(self, batch_id: str, after: int | None) -> Iterator[dict]:
        while True:
            params = {"limit": PAGE, **({"after": after} if after is not None else {})}
            page = self._request("GET", f"/batches/{batch_id}/results", params=params).json()
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["last_line"]

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send, retrying as the module docstring says: a call that may have taken effect is retried only if
        sending it again does no harm (an idempotent method)."""
        for attempt in range(self.max_retries + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                failure, wait = SluiceError(None, f"{method} {path}: {type(e).__name__}: {e}"), None
                retry = method in IDEMPOTENT or isinstance(e, NOT_SENT)
            else:
                if response.status_code < 400:
                    return response
                failure, wait = SluiceError.from_response(response), _retry_after(response.headers.get("retry-after"))
                if response.status_code not in REFUSED and response.status_code < 500:
                    raise failure
                retry = method in IDEMPOTENT or response.status_code in REFUSED
            if not retry:
                raise _maybe_done(failure, method, path)
            if attempt < self.max_retries:
                time.sleep(self._backoff(attempt) if wait is None else wait)
        raise failure

    def _backoff(self, attempt: int) -> float:
        """Exponential, with jitter so that clients refused together do not come back together; capped at MAX_WAIT."""
        return min(self.backoff * 2 ** attempt * random.uniform(0.5, 1.5), MAX_WAIT)


def text_of(result: dict) -> str | None:
    """The generated text of an output line (chat or completion), or None for an error line."""
    if result.get("response") is None:
        return None
    choice = result["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _maybe_done(failure: SluiceError, method: str, path: str) -> SluiceError:
    """A failed call that the server may have carried out all the same: saying so, as it is not sent again."""
    return SluiceError(failure.status, f"{failure.message}; {method} {path} was not retried, as the server may have "
                       "acted on it: check (e.g. GET) before sending it again", failure.param, failure.code)


def _retry_after(value: str | None) -> float | None:
    """The seconds a Retry-After header asks to wait (delay-seconds, decimals too, or an HTTP date), capped at
    MAX_WAIT; None when there is none or it cannot be read, so the backoff applies."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_WAIT) if math.isfinite(seconds) else None


def _jsonl(bodies: dict[str, dict], endpoint: str) -> bytes:
    return "".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}) + "\n"
                   for custom_id, body in bodies.items()).encode()


def _first_url(data: bytes) -> str:
    for raw in data.split(b"\n"):
        if raw.strip():
            try:
                return json.loads(raw)["url"]
            except (ValueError, KeyError, TypeError):
                break
    return CHAT_URL
