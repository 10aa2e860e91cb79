"""Serving an ASGI app in a test: uvicorn in a daemon thread on a free port of 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


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
