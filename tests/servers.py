"""Servers in a test: an ASGI app under uvicorn, and a webhook receiver, each in a daemon thread on a free port of
127.0.0.1; and `sluice serve` in a process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sluice_serve(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    """`sluice serve` with `flags` on a free port, its data in tmp_path/data and its log in tmp_path/serve.log,
    once /readyz answers; without the environment's SLUICE_* settings."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sluice", "serve", *flags, "--port", str(port), "--data-dir",
                             str(tmp_path / "data")], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        time.sleep(0.2)
    return proc, port


@contextmanager
def serve_app(app) -> Iterator[str]:
    """Yields the server's base URL (http://127.0.0.1:PORT) once it accepts connections; stops it afterwards."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no other process can take the port meanwhile
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST and answers with the next of `statuses` (then 200)."""

    def __init__(self, statuses: list[int]):
        self.statuses, self.received = list(statuses), []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.received.append((dict(self.headers), body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
