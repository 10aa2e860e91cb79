"""Delivering webhooks from the outbox: Standard Webhooks signatures, the SSRF guard, and attempts with backoff.

`deliver` attempts one outbox row (msg_...): it claims the row with a conditional UPDATE, so that two workers never
send it at once, POSTs it outside any transaction (for ATTEMPT_SECONDS at most, well within the claim), then records
the outcome. A 2xx ends it; anything else schedules the next attempt about 5 s, 10 s, 20 s ... later (doubling to at
most an hour, times a random 0.5-1.5) until a day after the event, when the delivery is marked failed. Every attempt
carries the same webhook-id, so that a receiver can drop repeats, and a fresh webhook-timestamp and signature.

The SSRF guard refuses URLs whose host resolves to an address that is not public (loopback, private, link-local
such as the cloud metadata address 169.254.169.254, ...) unless SLUICE_WEBHOOK_ALLOW_PRIVATE=1, both when an
endpoint is created and at every attempt, and the POST goes to the very address that was checked (DNS can change
in between). Proxies from the environment are not used: the guard must see where the request goes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import httpx
from celery import Celery
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from sluice.api.queue import DELIVER_WEBHOOK
from sluice.api.tables import WebhookDelivery, WebhookEndpoint
from sluice.api.text import storable

FIRST_DELAY = 5.0
MAX_DELAY = 3600.0
GIVE_UP_AFTER = 24 * 3600.0
TIMEOUT = 10.0  # each connect, read and write
ATTEMPT_SECONDS = 30.0  # the whole POST, however slowly the receiver answers
CLAIM_SECONDS = 60.0  # longer than any attempt: a worker that dies mid-attempt leaves the row due again after this
ERROR_CHARS = 500
NAT64, IPV4_COMPATIBLE = ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("::/96")


class UrlRefused(ValueError):
    """A webhook URL that must not be called; the message says why."""


@dataclass
class Outcome:
    """What `deliver` did: delivered, pending (next attempt at next_attempt_at), failed (gave up), or skipped (the
    delivery is not due, is being attempted elsewhere, is finished, or no longer exists)."""

    status: str
    next_attempt_at: float | None = None


def allow_private() -> bool:
    return os.environ.get("SLUICE_WEBHOOK_ALLOW_PRIVATE") == "1"


def check_url(url: str) -> list[str]:
    """The addresses the URL's host resolves to, all of them allowed; UrlRefused otherwise."""
    if not storable(url):  # no URL has a NUL or a lone surrogate, and the database could not store them
        raise UrlRefused(f"url {url!r}: has a NUL character or a lone surrogate")
    try:
        parts = urlsplit(url)
        port = _port(parts)
    except ValueError as e:  # brackets that close no IPv6 address, a port that is no number or out of range
        raise UrlRefused(f"url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRefused(f"url {url!r}: an http:// or https:// URL is required")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UrlRefused(f"url {url!r}: its host {parts.hostname!r} does not resolve ({e})") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private():
        for address in addresses:
            if not _public(ipaddress.ip_address(address)):
                # the address itself is not named: a caller would learn the internal address of any name
                raise UrlRefused(f"url {url!r}: an address of {parts.hostname} is not a public address (set "
                                 "SLUICE_WEBHOOK_ALLOW_PRIVATE=1 to allow private networks)")
    return addresses


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and (carried := _carried_ipv4(ip)) is not None:
        ip = carried
    return ip.is_global and not ip.is_multicast


def _carried_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address that an IPv6 one carries and is routed to: IPv4-mapped, 6to4 (2002::/16), NAT64's prefix
    64:ff9b::/96 or IPv4-compatible (::/96). Python counts the last three global whatever they carry, so
    64:ff9b::a9fe:a9fe reached the metadata address through a NAT64 gateway."""
    for carried in (ip.ipv4_mapped, ip.sixtofour):
        if carried is not None:
            return carried
    if ip in NAT64 or ip in IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme == "https" else 80)


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}"> keyed by the secret after whsec_."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def publish_deliveries(app: Celery, delivery_ids: Iterable[str]) -> None:
    """Send one delivery message per id to the webhooks queue; call after the transaction that wrote them commits."""
    with app.producer_or_acquire() as producer:
        for delivery_id in delivery_ids:
            app.send_task(DELIVER_WEBHOOK, args=[delivery_id], producer=producer)


def deliver(sessions: sessionmaker[Session], delivery_id: str) -> Outcome:
    """Attempt one delivery if it is due; returns what happened. Runs its own two short transactions."""
    now = time.time()
    with sessions.begin() as session:
        claimed = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == "pending",
                   WebhookDelivery.next_attempt_at <= now)
            .values(attempts=WebhookDelivery.attempts + 1, next_attempt_at=now + CLAIM_SECONDS)
            .returning(WebhookDelivery.endpoint_id, WebhookDelivery.payload, WebhookDelivery.attempts,
                       WebhookDelivery.created_at)).first()
        if claimed is None:
            return Outcome("skipped")
        endpoint = session.get(WebhookEndpoint, claimed.endpoint_id)
        url, secret = endpoint.url, endpoint.secret
    status_code, error = _post(url, secret, delivery_id, claimed.payload)
    with sessions.begin() as session:
        return _record(session, delivery_id, claimed.attempts, claimed.created_at, status_code, error)


def _post(url: str, secret: str, msg_id: str, payload: dict) -> tuple[int | None, str | None]:
    """POST the signed event to the checked address; (status code, None) on a 2xx, else (code or None, why)."""
    try:
        address = check_url(url)[0]
    except UrlRefused as e:
        return None, str(e)
    parts = urlsplit(url)
    body = json.dumps(payload, separators=(",", ":")).encode()
    timestamp = int(time.time())
    headers = {"content-type": "application/json", "user-agent": "sluice-webhooks",
               "host": parts.netloc.rpartition("@")[2], "webhook-id": msg_id, "webhook-timestamp": str(timestamp),
               "webhook-signature": signature(secret, msg_id, timestamp, body)}
    host = f"[{address}]" if ":" in address else address
    userinfo = parts.netloc.rpartition("@")[0]
    pinned = parts._replace(netloc=(userinfo + "@" if userinfo else "") + f"{host}:{_port(parts)}").geturl()
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    cutoff = Cutoff(ATTEMPT_SECONDS)
    try:
        with cutoff, httpx.Client(timeout=TIMEOUT, follow_redirects=False, trust_env=False) as client, \
                client.stream("POST", pinned, content=body, headers=headers,
                              extensions=extensions | {"trace": cutoff.trace}) as response:
            if 200 <= response.status_code < 300:
                return response.status_code, None
            return response.status_code, f"HTTP {response.status_code}: {_start(response)}"[:ERROR_CHARS]
    except httpx.HTTPError as e:
        if cutoff.fired:
            return None, f"no complete answer within {ATTEMPT_SECONDS:g} s"
        return None, f"{type(e).__name__}: {e}"[:ERROR_CHARS]


def _start(response: httpx.Response) -> str:
    """The first ERROR_CHARS bytes of an answer's body, all that is kept of it: read whole, a receiver's endless body
    was held in memory (gigabytes within the attempt's 30 s)."""
    start = b""
    for chunk in response.iter_bytes():
        start += chunk
        if len(start) >= ERROR_CHARS:
            break
    return start[:ERROR_CHARS].decode(response.encoding or "utf-8", errors="replace")


class Cutoff:
    """Shuts an attempt's connections down once its time is up. httpx's timeouts bound each read, not their sum: a
    receiver trickling its answer a byte at a time outlasted the claim, and the row, due again, was sent a second
    time while the first attempt was still in flight (and a few such receivers could hold every webhooks thread)."""

    def __init__(self, seconds: float):
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.fired = self.done = False
        self.timer = threading.Timer(seconds, self.fire)
        self.timer.daemon = True

    def trace(self, event: str, info: dict) -> None:
        """httpx's trace extension: note each connection's socket (the TLS one too) as it is opened."""
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            with self.lock:
                self.sockets.append(info["return_value"].get_extra_info("socket"))
                if self.fired:  # opened after the time ran out
                    _shut(self.sockets[-1])

    def fire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                for sock in self.sockets:
                    _shut(sock)

    def __enter__(self) -> Cutoff:
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.done = True
        self.timer.cancel()


def _shut(sock: socket.socket) -> None:
    """Wake the read blocked on it: the read fails, and so does the attempt."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already, or the plain socket a TLS one was built on
        pass


def _record(session: Session, delivery_id: str, attempts: int, created_at: float, status_code: int | None,
            error: str | None) -> Outcome:
    now = time.time()
    values: dict = {"last_status_code": status_code, "last_error": error}
    if error is None:
        values |= {"status": "delivered", "delivered_at": now}
        outcome = Outcome("delivered")
    else:
        next_at = now + min(FIRST_DELAY * 2 ** (attempts - 1), MAX_DELAY) * random.uniform(0.5, 1.5)
        outcome = Outcome("failed") if next_at > created_at + GIVE_UP_AFTER else Outcome("pending", next_at)
        values |= {"status": outcome.status, "next_attempt_at": next_at}
    # the endpoint may have been deleted meanwhile, and its deliveries with it: then this changes nothing
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id,
                                                  WebhookDelivery.status == "pending").values(**values))
    return outcome
