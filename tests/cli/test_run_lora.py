"""`sluice run` with LoRA adapters: a line's `model` picks an adapter or the base model; an unknown name is an error
line; malformed flags and bad adapters stop the command before any line runs, naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from lora_fixtures import check_mixed, completion_line, engine_texts, mixed_lines
from test_run import read_jsonl, write_jsonl

from sluice.worker.cli import main


def run(tmp_path, lines, llama_dir, *flags):
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    code = main(["run", str(source), "-o", str(out), "--model", str(llama_dir), "--served-model-name", "tiny",
                 *flags])
    results = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)} if out.exists() else {}
    errors = read_jsonl(tmp_path / "out.errors.jsonl") if (tmp_path / "out.errors.jsonl").exists() else []
    return code, results, errors


def test_lines_pick_adapters_by_model_and_an_unknown_one_is_an_error_line(tmp_path, llama_dir, lora_dir):
    lines = [*mixed_lines("tiny", unnamed=True), completion_line("unknown", "c", "The zen of")]
    code, bodies, errors = run(tmp_path, lines, llama_dir, "--lora-dir", str(lora_dir), "--max-num-seqs", "4")
    assert code == 1 and [(e["custom_id"], e["error"]["code"], e["error"]["param"]) for e in errors] == [
        ("unknown", "model_not_found", "body.model")]
    assert "'c' is not served here (served: tiny, a, b)" in errors[0]["error"]["message"]
    check_mixed({k: b["choices"][0]["text"] for k, b in bodies.items()},
                engine_texts(llama_dir, lora_dir, lines[:-1], "tiny"), "tiny")
    assert {k: b["model"] for k, b in bodies.items() if k.startswith(("a-", "b-", "none-"))} == {
        k: "tiny" if k.startswith("none") else k[0] for k in bodies if k.startswith(("a-", "b-", "none-"))}


@pytest.mark.parametrize("flags, message", [
    (["--lora", "a"], "--lora 'a': give NAME=PATH"),
    (["--lora", "=x"], "an adapter name has 1 to 255 characters"),
    (["--lora", "a=x", "--lora", "a=y"], "adapter name 'a' is given twice"),
    (["--lora", "tiny=x"], "adapter name 'tiny' is the base model's served name"),
    (["--lora-dir", "/nonexistent/loras"], "--lora-dir /nonexistent/loras: directory not found"),
])
def test_malformed_lora_flags_are_usage_errors(tmp_path, llama_dir, capsys, flags, message):
    code, _, _ = run(tmp_path, [completion_line("x", None, "Hi")], llama_dir, *flags)
    assert code == 2 and message in capsys.readouterr().err


def test_a_bad_adapter_stops_the_run_naming_it(tmp_path, llama_dir, lora_dir, capsys):
    lines = [completion_line("x", None, "Hi")]
    code, bodies, _ = run(tmp_path, lines, llama_dir, "--lora", f"big={lora_dir / 'a'}", "--max-lora-rank", "4")
    err = capsys.readouterr().err
    assert code == 2 and bodies == {} and "adapter 'big'" in err and "above max_lora_rank 4" in err
    broken = tmp_path / "broken"
    shutil.copytree(lora_dir / "b", broken)
    (broken / "adapter_model.safetensors").unlink()
    code, bodies, _ = run(tmp_path, lines, llama_dir, "--lora", f"b={broken}")
    err = capsys.readouterr().err
    assert code == 2 and "adapter 'b'" in err and "adapter_model.safetensors not found" in err
    config = json.loads((broken / "adapter_config.json").read_text())
    assert config["r"] == 4  # the copy was the rank-4 adapter: only the missing file stopped it
