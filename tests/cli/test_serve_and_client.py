"""`sluice serve` and the Python client as a user meets them: a port or a data directory it cannot use is one clear
line at once, the API key file is private from its creation, Ctrl-C twice gives the running requests back at once
without a traceback, and map_documents keys every result by its document, even one whose id the server refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from servers import free_port

from sluice.api import db
from sluice.api.client import Client, text_of
from sluice.worker.cli.serve import local_key


def serve_args(model: Path, port: int, data_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sluice", "serve", "--model", str(model), "--served-model-name", "tiny",
            "--port", str(port), "--data-dir", str(data_dir), *extra]


def serve_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}


def start_serve(model: Path, port: int, data_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`sluice serve`, once its API answers with its key in `data_dir`; its stdout and stderr go to `log`."""
    proc = subprocess.Popen(serve_args(model, port, data_dir, *extra), env=serve_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    wait_until(lambda: ready(port), 120, lambda: log.read_text(), proc)
    return proc


def ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def wait_until(condition, timeout: float, explain=lambda: "", proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert proc is None or proc.poll() is None, explain()
        assert time.monotonic() < deadline, explain()
        time.sleep(0.1)
    return value


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_statuses(database: Path) -> dict[str, int]:
    with sqlite3.connect(database, timeout=30) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())


def test_a_port_in_use_is_one_line_at_once_not_a_server_without_its_api(tmp_path, llama_dir):
    with socket.socket() as taken:  # another server (another sluice serve) listens there already
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # it went on without its API: a worker printing the other server's address and a key not valid there
        done = subprocess.run(serve_args(llama_dir, port, tmp_path / "data"), env=serve_env(), capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"sluice serve: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("occupied", ["sluice.db", "api_key"])
def test_a_data_dir_it_cannot_write_is_one_line_not_a_traceback(tmp_path, llama_dir, occupied):
    data = tmp_path / "data"
    (data / occupied).mkdir(parents=True)  # as root (CI), a directory in the file's place is what refuses a write
    done = subprocess.run(serve_args(llama_dir, free_port(), data), env=serve_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"sluice serve: --data-dir {data}: cannot keep the database and API key there: ")


def test_the_api_key_file_is_private_from_its_creation(tmp_path, monkeypatch):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'sluice.db'}")
    db.upgrade(engine)
    sessions = db.session_factory(engine)
    monkeypatch.setattr(Path, "chmod", lambda *_: None)  # what a chmod after the write would fix, a moment late
    umask = os.umask(0o022)
    try:
        key = local_key(sessions, tmp_path / "api_key")
        stale = tmp_path / "stale_key"
        stale.write_text("sk-sluice-revoked\n")  # 0644, its key no longer valid: a new key replaces it
        replaced = local_key(sessions, stale)
    finally:
        os.umask(umask)
    assert (tmp_path / "api_key").read_text() == key + "\n" and stale.read_text() == replaced + "\n"
    assert (tmp_path / "api_key").stat().st_mode & 0o777 == 0o600 and stale.stat().st_mode & 0o777 == 0o600
    assert local_key(sessions, tmp_path / "api_key") == key  # kept across starts


def test_ctrl_c_twice_gives_running_requests_back_at_once_without_tracebacks(tmp_path, llama_dir):
    port, data, log = free_port(), tmp_path / "data", tmp_path / "serve.log"
    proc = start_serve(llama_dir, port, data, log, "--max-num-seqs", "2")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=(data / "api_key").read_text().strip(),
                               max_retries=0)
        lines = [{"custom_id": f"long{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}"}],
                           "max_tokens": 1500, "ignore_eos": True}} for i in range(16)]
        data_file = "".join(json.dumps(line) + "\n" for line in lines).encode()
        file = client.files.create(file=("input.jsonl", data_file), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_until(lambda: request_statuses(data / "sluice.db").get("running"), 60, log.read_text, proc)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "Warm shutdown" in log.read_text(), 60, log.read_text, proc)
        proc.send_signal(signal.SIGINT)  # Celery's cold shutdown: the threads pool cannot kill its tasks
        proc.wait(timeout=120)
    finally:
        stop(proc)
    output = log.read_text()
    assert "Traceback" not in output and "stopping the engine now" in output, output
    statuses = request_statuses(data / "sluice.db")
    assert set(statuses) <= {"queued", "completed"} and sum(statuses.values()) == 16, statuses
    with sqlite3.connect(data / "sluice.db") as conn:
        counts = conn.execute("SELECT status, request_completed, request_failed FROM batches WHERE id = ?",
                              (batch.id,)).fetchone()
    assert counts == ("in_progress", statuses.get("completed", 0), 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_dir):
    """A `sluice serve` of the tiny Llama: (base URL, API key)."""
    tmp, port = tmp_path_factory.mktemp("serve"), free_port()
    proc = start_serve(llama_dir, port, tmp / "data", tmp / "serve.log")
    try:
        yield f"http://127.0.0.1:{port}", (tmp / "data" / "api_key").read_text().strip()
    finally:
        stop(proc)


def test_map_documents_keys_every_result_by_its_document(served):
    url, key = served
    with Client(url, key, poll_interval=0.1) as client:
        results = client.map_documents("Summarise {text}", {"": "no id", "ok": "fine", "odd\ud800": "bad id"},
                                       model="tiny", max_tokens=4, temperature=0, progress=False)
    # the server's error lines for ids it refused carried custom_id None (or a readable copy of the id)
    assert set(results) == {"", "ok", "odd\ud800"}
    assert results[""]["error"]["param"] == "custom_id" and results["odd\ud800"]["error"]["code"] == "invalid_value"
    assert text_of(results["ok"])  # greedy: sampled, the tiny model's first token may be its eos (no text)


@pytest.mark.parametrize("base_url", ["localhost:8000", "127.0.0.1:8000/v1"])
def test_a_base_url_without_its_scheme_is_refused_at_once(base_url):
    # it was retried with backoff, and a POST's error said the server may have acted on it
    with pytest.raises(ValueError, match="give the server's address with its scheme"):
        Client(base_url, "key")
