"""`sluice submit`, `sluice status` and `sluice results`, run in-process against the test databases and Redis."""

from __future__ import annotations

import datetime
import errno
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from store_test_utils import chat, jsonl, ok, read_chunks

from sluice.api import store
from sluice.api.tables import ApiKey, Batch
from sluice.worker.cli import main


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
    (["results", "batch_nope", "-o", "{tmp}"], "is a directory"),
    (["results", "batch_nope", "-o", "{tmp}/out.jsonl", "--errors", "{tmp}"], "is a directory"),
    (["serve", "--model", "demo", "--data-dir", "{input}"], "--data-dir"),
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


@pytest.mark.parametrize("argv, setting, value", [
    (["submit", "{input}"], "SLUICE_CHUNK_SIZE", "0"),
    (["worker", "--model", "demo"], "SLUICE_CHUNK_SIZE", "0"),
    (["worker", "--model", "demo"], "SLUICE_GPU_HOUR_COST", "abc"),
    (["serve", "--model", "demo", "--data-dir", "{tmp}/data"], "SLUICE_GPU_HOUR_COST", "-1"),
    (["api"], "SLUICE_CHUNK_SIZE", "x"),
    (["worker", "--model", "demo"], "SLUICE_RECONCILE_SECONDS", "soon"),
    (["serve", "--model", "demo", "--data-dir", "{tmp}/data"], "SLUICE_RECONCILE_SECONDS", "0"),
])
def test_a_malformed_setting_is_named_before_anything_is_stored_or_loaded(tmp_path, sessions, cli_env, capsys,
                                                                          monkeypatch, argv, setting, value):
    """`sluice submit` stored the batch, then failed with a traceback on SLUICE_CHUNK_SIZE as it published it;
    `sluice worker` and `sluice serve` gave tracebacks (serve after loading its model); `sluice api` served and failed
    each batch as it was created."""
    def started(*args):
        raise AssertionError("the API server started")
    monkeypatch.setattr("sluice.api.server.serve", started)
    monkeypatch.setenv(setting, value)
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat("a", model="tiny")]))
    code, out, err = sluice(capsys, *(a.format(input=source, tmp=tmp_path) for a in argv))
    assert code == 2 and err.startswith(f"sluice {argv[0]}: {setting}={value!r}: ") and len(err.splitlines()) == 1
    assert out == "" and cli_env.keys("model.*") == [] and not (tmp_path / "data").exists()
    with sessions.begin() as session:
        assert session.scalars(select(Batch)).all() == []


def test_keys_revoke_given_the_key_itself_asks_for_its_id_or_prefix(tmp_path, cli_env, capsys):
    """The key is what `sluice keys create` prints on stdout; revoking with it answered 'not found' (and echoed it)."""
    key = sluice(capsys, "keys", "create", "--tenant", "team-a")[1].splitlines()[-1]
    code, out, err = sluice(capsys, "keys", "revoke", key)
    assert code == 2 and key not in err
    assert err == (f"sluice keys: give the key's id (key_...) or its prefix ({key[:14]}), as `sluice keys create` "
                   "printed them, not the key itself\n")
    assert sluice(capsys, "keys", "revoke", key[:14])[0] == 0
    assert sluice(capsys, "keys", "revoke", "sk-sluice-none")[2] == "sluice keys: API key sk-sluice-none not found\n"


def test_keys_revoke_of_a_revoked_key_says_since_when_and_changes_nothing(sessions, cli_env, capsys):
    """A second revoke printed 'revoked key_...' again, as if it had done something."""
    err = sluice(capsys, "keys", "create", "--tenant", "team-a")[2]
    key_id, prefix = err.split("created ")[1].split(" ")[0], err.split("(prefix ")[1].split(")")[0]
    assert sluice(capsys, "keys", "revoke", prefix) == (0, "", f"sluice keys: revoked {key_id} (prefix {prefix})\n")
    with sessions.begin() as session:
        revoked_at = session.get(ApiKey, key_id).revoked_at
    since = datetime.datetime.fromtimestamp(revoked_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    for again in (key_id, prefix):
        assert sluice(capsys, "keys", "revoke", again) == (
            0, "", f"sluice keys: {key_id} (prefix {prefix}) has been revoked since {since}; nothing changed\n")
    with sessions.begin() as session:
        assert session.get(ApiKey, key_id).revoked_at == revoked_at
    assert sluice(capsys, "keys", "revoke", "key_nope") == (2, "", "sluice keys: API key key_nope not found\n")


def test_serve_names_the_host_of_its_in_memory_broker(caplog):
    """kombu warned 'No hostname was supplied. Reverting to default 'localhost'' as `sluice serve` started and at
    every message it re-sent."""
    from kombu import Connection

    from sluice.worker.cli.serve import BROKER_URL

    with caplog.at_level(logging.WARNING), Connection(BROKER_URL) as connection:
        connection.ensure_connection()
    assert connection.as_uri() == "memory://:**@localhost//" and caplog.records == []


def submitted(tmp_path, capsys, lines: list) -> str:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(lines))
    code, out, _ = sluice(capsys, "submit", source, "--model", "tiny")
    assert code == 0
    return out.splitlines()[-1]


def test_results_keep_the_previous_files_when_writing_fails(tmp_path, cli_env, capsys, monkeypatch):
    batch_id = submitted(tmp_path, capsys, [chat("a"), "{bad"])
    output, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    output.write_text("previous output\n")
    errors.write_text("previous errors\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("sluice.worker.cli.common.os.fsync", full)
    code, _, err = sluice(capsys, "results", batch_id, "-o", output)
    assert code == 2 and f"{output}: No space left on device" in err
    assert (output.read_text(), errors.read_text()) == ("previous output\n", "previous errors\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.errors.jsonl", "out.jsonl"]


def test_submit_keeps_the_apis_limits_and_reads_no_more_of_a_file_than_the_limit(tmp_path, cli_env, capsys,
                                                                                 monkeypatch):
    """`sluice submit` read a whole file before refusing it (a 1 GB file: 1.1 GB of memory) and took the default
    limits whatever SLUICE_MAX_FILE_BYTES and SLUICE_MAX_BATCH_LINES said."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat(str(i)) for i in range(3)]))
    monkeypatch.setenv("SLUICE_MAX_BATCH_LINES", "2")
    code, out, err = sluice(capsys, "submit", source)
    assert code == 1 and "the input file has 3 requests; a batch takes at most 2" in err
    monkeypatch.setenv("SLUICE_MAX_FILE_BYTES", "100")
    read, original = [], Path.open

    def counted(path, *args, **kwargs):
        file = original(path, *args, **kwargs)
        whole = file.read
        file.read = lambda size=-1: read.append(len(data := whole(size))) or data
        return file
    monkeypatch.setattr(Path, "open", counted)
    monkeypatch.setattr(Path, "read_bytes", lambda path: counted(path, "rb").read())
    code, out, err = sluice(capsys, "submit", source)
    assert code == 2 and "larger than the limit of 100 bytes (SLUICE_MAX_FILE_BYTES)" in err and out == ""
    assert read == [101]
    monkeypatch.setenv("SLUICE_MAX_FILE_BYTES", "lots")
    assert sluice(capsys, "submit", source)[2] == "sluice submit: SLUICE_MAX_FILE_BYTES='lots': give a whole number, " \
                                                  "at least 1\n"


def test_an_unreadable_input_is_named(tmp_path, cli_env, capsys, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat("a")]))

    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    monkeypatch.setattr(Path, "open", denied)  # as root, chmod would not keep the test out
    monkeypatch.setattr(Path, "read_bytes", denied)
    code, out, err = sluice(capsys, "submit", source)
    assert code == 2 and err == f"sluice submit: {source}: Permission denied\n" and out == ""


def test_a_malformed_database_url_is_named(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_DATABASE_URL", "bogus")
    code, _, err = sluice(capsys, "status", "batch_x")
    assert code == 2 and err.startswith("sluice status: SLUICE_DATABASE_URL 'bogus': ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [["api", "--port", "99999"], ["serve", "--model", "demo", "--port", "0"]])
def test_ports_outside_1_to_65535_are_refused(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "is not a port (1-65535)" in capsys.readouterr().err


def test_a_closed_stdout_stops_quietly(tmp_path, cli_env, capsys):
    batch_id = submitted(tmp_path, capsys, [chat("a")])
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from sluice.worker.cli import main; sys.exit(main())",
                             "status", batch_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `sluice status B | head -0`: the reader has gone before the first write
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1 and err == ""


def test_an_unmigrated_database_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    code, _, err = sluice(capsys, "status", "batch_x")
    assert code == 2 and "no such table" in err and "sluice db upgrade" in err


def test_api_and_the_cli_parser_import_no_torch():
    """The parser of every command, and the API-only commands' modules, load neither the engine nor the GPU worker."""
    check = ("import sys, sluice.api.db, sluice.api.tables, sluice.api.queue, sluice.api.store, sluice.worker.cli; "
             "from sluice.worker.cli import api, batches, db, keys; sluice.worker.cli.build_parser(); "
             "engine = {'torch', 'sluice.worker.engine', 'sluice.worker.gpu_worker', 'sluice.worker.bridge'}; "
             "assert not engine & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", check], check=True, capture_output=True)
