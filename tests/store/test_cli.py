"""`sluice submit`, `sluice status` and `sluice results`, run in-process against the test databases and Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from store_test_utils import chat, jsonl, ok, read_chunks

from api import store
from worker.cli import main


@pytest.fixture
def cli_env(engine, broker, monkeypatch):
    monkeypatch.setenv("SLUICE_DATABASE_URL", engine.url.render_as_string(hide_password=False))
    return broker


def sluice(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_status_results(tmp_path, sessions, cli_env, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat("a"), chat("b", model="ignored"), "{bad", chat("c")]))
    code, out, err = sluice(capsys, "submit", source, "--model", "tiny", "--priority", "2", "--tenant", "team-a")
    batch_id = out.splitlines()[-1]
    assert code == 0 and batch_id.startswith("batch_")
    assert "3 requests queued for model 'tiny', 1 invalid" in err and "no live worker serves 'tiny'" in err
    [chunk] = read_chunks(cli_env, "model.tiny:2")

    with sessions.begin() as session:
        assert store.get_batch(session, batch_id).tenant_id == store.get_or_create_tenant(session, "team-a").id
        ids = [r.id for r in store.claim(session, chunk["ids"], "w1", 60)]
    assert len(ids) == 3
    with sessions.begin() as session:
        store.write_results(session, [ok(ids[2], text="third"), ok(ids[0], text="first")], "w1")

    code, out, _ = sluice(capsys, "status", batch_id)
    status = json.loads(out)
    assert code == 0 and (status["id"], status["status"], status["model"]) == (batch_id, "in_progress", "tiny")
    assert status["request_counts"] == {"total": 4, "completed": 2, "failed": 1}
    assert status["usage"]["input_tokens"] == 10

    output = tmp_path / "out.jsonl"
    code, _, err = sluice(capsys, "results", batch_id, "-o", output)
    assert code == 0 and "2 output lines" in err and "in_progress" in err
    assert [r["custom_id"] for r in map(json.loads, output.read_text().splitlines())] == ["a", "c"]
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["error"]["code"], e["error"]["line"]) for e in errors] == [("invalid_json_line", 3)]

    with sessions.begin() as session:
        store.write_results(session, [ok(ids[1], text="second")], "w1")
    code, _, _ = sluice(capsys, "results", batch_id, "-o", output, "--errors", tmp_path / "e.jsonl")
    bodies = [r["response"]["body"]["choices"][0]["message"]["content"]
              for r in map(json.loads, output.read_text().splitlines())]
    assert bodies == ["first", "second", "third"]
    assert json.loads(sluice(capsys, "status", batch_id)[1])["status"] == "completed"


def test_submit_takes_the_model_from_the_lines_and_fails_an_empty_file(tmp_path, cli_env, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat("a", model="from-lines")]))
    code, out, _ = sluice(capsys, "submit", source)
    assert code == 0 and cli_env.llen("model.from-lines:5") == 1
    source.write_bytes(b"\n")
    code, out, err = sluice(capsys, "submit", source)
    assert code == 1 and "batch failed: the input file has no requests" in err
    assert json.loads(sluice(capsys, "status", out.splitlines()[-1])[1])["status"] == "failed"


@pytest.mark.parametrize("argv, message", [
    (["submit", "missing.jsonl"], "not found"),
    (["submit", "{input}", "--priority", "12"], "priority 12 is out of range"),
    (["submit", "{input}", "--completion-window", "soon"], "completion_window 'soon'"),
    (["submit", "{input}", "--tenant", "bad name"], "tenant name"),
    (["status", "batch_nope"], "batch batch_nope not found"),
    (["results", "batch_nope", "-o", "{tmp}/out.jsonl"], "batch batch_nope not found"),
    (["results", "batch_nope", "-o", "{tmp}/no/such/dir/out.jsonl"], "not found"),
    (["worker", "--model", "demo", "--engine-threads", "0"], "--engine-threads must be at least 1"),
    (["worker", "--model", "demo", "--engine-nice", "-21"], "--engine-nice must be from -20 to 19, got -21"),
    (["worker", "--model", "demo", "--window-seconds", "0"], "--window-seconds must be positive, got 0.0"),
])
def test_mistakes_exit_2_with_a_message(tmp_path, cli_env, capsys, argv, message):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat("a")]))
    code, out, err = sluice(capsys, *(a.format(input=source, tmp=tmp_path) for a in argv))
    assert code == 2 and message in err and out == ""
    assert cli_env.keys("model.*") == []


def test_an_unmigrated_database_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    code, _, err = sluice(capsys, "status", "batch_x")
    assert code == 2 and "no such table" in err and "sluice db upgrade" in err


def test_api_and_the_cli_parser_import_no_torch():
    check = ("import sys, api.db, api.models, api.queue, api.store, worker.cli; worker.cli.build_parser(); "
             "assert not {'torch', 'worker.engine'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", check], check=True, capture_output=True)
