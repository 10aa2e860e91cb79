"""`sluice run` end to end: OpenAI batch lines in, the engine's own results out, bad lines reported, runs resumable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.api.batch_lines import CHAT_URL, COMPLETIONS_URL
from sluice.worker.cli import main
from sluice.worker.engine import LLM, LLMEngine, SamplingParams
from sluice.worker.run import QUEUE_DEPTH, finished_ids


def chat(custom_id: str, content: str = "Hello there", **body) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": "m", "messages": messages, **body}}


def completion(custom_id: str, prompt="The zen of", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL,
            "body": {"model": "m", "prompt": prompt, **body}}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sluice_run(tmp_path: Path, lines: list, model, *flags: str) -> tuple[int, dict[str, dict], list[dict]]:
    """Run the CLI in-process; returns the exit code, response bodies by custom_id, and error lines."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    code = main(["run", str(source), "-o", str(out), "--model", str(model), *flags])
    results = {r["custom_id"]: r for r in read_jsonl(out)} if out.exists() else {}
    for r in results.values():
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
    return code, {k: r["response"]["body"] for k, r in results.items()}, read_jsonl(tmp_path / "out.errors.jsonl")


@pytest.fixture(scope="module")
def reference(llama_dir):
    return LLM(str(llama_dir))


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_outputs_equal_the_engine_own(tmp_path, llama_dir, reference):
    system = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    lines = [
        chat("c1", "Hello there", max_tokens=6, temperature=0),
        chat("c2", "Beautiful is better than ugly", max_completion_tokens=9, temperature=0),
        {**chat("c3"), "body": {"messages": system, "max_tokens": 5, "temperature": 0}},
        completion("p1", "The zen of", max_tokens=7, temperature=0),
        completion("p2", [5, 17, 33, 90], max_tokens=4, temperature=0),
        completion("p3", ["Simple is better"], max_tokens=8, temperature=0),
        completion("s1", "Sampled", max_tokens=6, temperature=0.8, seed=7),
    ]
    code, bodies, errors = sluice_run(tmp_path, lines, llama_dir, "--max-num-seqs", "2")
    assert (code, errors) == (0, [])
    system_as_template_sees_it = [{"role": "system", "content": "Be brief."}, system[1]]
    expected = {
        "c1": reference.chat([{"role": "user", "content": "Hello there"}], greedy(6))[0],
        "c2": reference.chat([{"role": "user", "content": "Beautiful is better than ugly"}], greedy(9))[0],
        "c3": reference.chat(system_as_template_sees_it, greedy(5))[0],
        "p1": reference.generate("The zen of", greedy(7))[0],
        "p2": reference.generate([5, 17, 33, 90], greedy(4))[0],
        "p3": reference.generate("Simple is better", greedy(8))[0],
        "s1": reference.generate("Sampled", SamplingParams(max_tokens=6, temperature=0.8, seed=7))[0],
    }
    assert set(bodies) == set(expected)
    for custom_id, want in expected.items():
        body = bodies[custom_id]
        choice = body["choices"][0]
        is_chat = custom_id.startswith("c")
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if is_chat else "cmpl-")
        assert body["model"] == llama_dir.name and isinstance(body["created"], int)
        assert (choice["message"]["content"] if is_chat else choice["text"]) == want.text
        assert choice["finish_reason"] == want.finish_reason and choice["logprobs"] is None
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
        assert usage["completion_tokens"] == len(want.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert bodies["c1"]["choices"][0]["message"]["role"] == "assistant"


def test_n_choices_have_their_indices_their_seeds_and_usage_counting_the_prompt_once(tmp_path, llama_dir,
                                                                                     reference):
    content = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."
    lines = [chat("c3", content, n=3, max_tokens=6, temperature=0.9, seed=5, logprobs=True, top_logprobs=2),
             completion("p2", "The zen of", n=2, max_tokens=4, temperature=0.8, seed=9, logprobs=1),
             chat("c1", content, n=1, max_tokens=6, temperature=0)]
    code, bodies, errors = sluice_run(tmp_path, lines, llama_dir, "--max-num-seqs", "2")
    assert (code, errors) == (0, [])
    messages = [{"role": "user", "content": content}]
    for custom_id, n, seed, run in [("c3", 3, 5, lambda p: reference.chat(messages, p)[0]),
                                    ("p2", 2, 9, lambda p: reference.generate("The zen of", p)[0])]:
        body = bodies[custom_id]
        assert [c["index"] for c in body["choices"]] == list(range(n))
        wants = [run(SamplingParams(max_tokens=6 if n == 3 else 4, temperature=0.9 if n == 3 else 0.8, seed=seed + i))
                 for i in range(n)]
        for choice, want in zip(body["choices"], wants, strict=True):
            assert (choice["message"]["content"] if n == 3 else choice["text"]) == want.text
            assert choice["finish_reason"] == want.finish_reason and choice["logprobs"] is not None
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(wants[0].prompt_token_ids)  # once, not n times
        assert usage["completion_tokens"] == sum(len(w.token_ids) for w in wants)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(bodies["c1"]["choices"]) == 1 and bodies["c1"]["choices"][0]["index"] == 0


def test_every_bad_line_is_reported_and_the_rest_runs(tmp_path, llama_dir):
    def bad_body(custom_id: str, url: str = COMPLETIONS_URL, **body) -> dict:
        base = {"messages": [{"role": "user", "content": "hi"}]} if url == CHAT_URL else {"prompt": "hi"}
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {**base, **body}}

    cases = [  # (line, expected code, text the message must contain); None marks a good line
        (chat("g1", max_tokens=3), None, None),
        ("not json", "invalid_json_line", "not valid JSON"),
        ("[1, 2]", "invalid_json_line", "must be a JSON object"),
        ({"method": "POST", "url": CHAT_URL, "body": {}}, "missing_required_parameter", "custom_id: required"),
        (completion("g1", max_tokens=3), "duplicate_custom_id", "'g1' is already used by line 1"),
        ({**completion("u1"), "url": "/v1/embeddings"}, "invalid_url", "url: "),
        ({**completion("m1"), "method": "GET"}, "invalid_method", "method: "),
        (bad_body("t1", temperature="hot"), "invalid_value", "body.temperature: Input should be a valid number"),
        (bad_body("t2", temperature=2.5), "invalid_value", "body.temperature: Input should be less than or equal to 2"),
        (bad_body("t3", top_p=0), "invalid_value", "body.top_p"),
        (bad_body("t4", max_tokens=0), "invalid_value", "body.max_tokens"),
        (bad_body("n0", n=0), "invalid_value", "body.n: Input should be greater than or equal to 1"),
        (bad_body("n9", n=129), "invalid_value", "body.n: Input should be less than or equal to 128"),
        (bad_body("tc", CHAT_URL, tools=[{"type": "function", "function": {"name": "f"}}]), "unsupported_value",
         'body.tool_choice: tools without tool_choice means "auto"'),
        (bad_body("st", stream=True), "unsupported_value", "body.stream"),
        (bad_body("uf", frobnicate=1), "unknown_parameter", "body.frobnicate: unknown field"),
        (bad_body("s5", stop=["a", "b", "c", "d", "e"]), "invalid_value", "body.stop"),
        (bad_body("pp", prompt=["one", "two"]), "unsupported_value", "body.prompt: 2 prompts in one line"),
        (bad_body("tl", CHAT_URL, logprobs=True, top_logprobs=25), "invalid_value", "body.top_logprobs"),
        (bad_body("lp", logprobs=6), "invalid_value", "body.logprobs"),
        (bad_body("em", CHAT_URL, messages=[]), "invalid_value", "body.messages"),
        (bad_body("ro", CHAT_URL, messages=[{"role": "tool", "content": "x"}]), "unsupported_value",
         "body.messages.0.role"),
        (bad_body("rw", CHAT_URL, messages=[{"role": "wizard", "content": "x"}]), "invalid_value",
         "body.messages.0.role"),
        (bad_body("pe", presence_penalty=2.5), "invalid_value", "body.presence_penalty: Input should be less than or "
                                                                 "equal to 2"),
        (bad_body("lb", logit_bias={"5": 1, "99999": 1}), "invalid_value",
         "body.logit_bias: logit_bias has token id 99999, outside the model's vocabulary"),
        ({**completion("nb"), "body": "hi"}, "invalid_value", "body: Input should be a valid dictionary"),
        (bad_body("long", prompt=[7] * 2100, max_tokens=4), "context_length_exceeded", "max_model_len (2048)"),
        ("", None, None),  # blank lines are skipped, but still counted in line numbers
        (completion("g2", max_tokens=3), None, None),
    ]
    code, bodies, errors = sluice_run(tmp_path, [line for line, _, _ in cases], llama_dir)
    assert code == 1
    assert set(bodies) == {"g1", "g2"}
    expected = {n: (c, text) for n, (_, c, text) in enumerate(cases, 1) if c}
    assert sorted(e["error"]["line"] for e in errors) == sorted(expected)
    for record in errors:
        error = record["error"]
        code_wanted, text = expected[error["line"]]
        assert record["response"] is None and record["id"].startswith("batch_req_")
        assert error["code"] == code_wanted, error
        assert error["message"].startswith(f"line {error['line']}: ") and text in error["message"], error
    by_line = {e["error"]["line"]: e for e in errors}
    assert by_line[8]["custom_id"] == "t1" and by_line[8]["error"]["param"] == "body.temperature"
    assert by_line[2]["custom_id"] is None


def test_penalties_logit_bias_and_min_tokens_equal_the_engine_own(tmp_path, llama_dir, reference):
    vocab = reference.model_config.vocab_size
    eos = reference.tokenizer.eos_token_id
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    lines = [
        completion("plain", max_tokens=8, temperature=0),
        completion("pen", max_tokens=8, temperature=0, **penalties),
        chat("bias", max_tokens=6, temperature=0, logit_bias={"40": 5, str(eos): -100}),
        completion("min", max_tokens=6, temperature=0, min_tokens=4, logit_bias={str(eos): 100}),
        completion("bad", max_tokens=6, logit_bias={str(vocab): 1}),
    ]
    code, bodies, errors = sluice_run(tmp_path, lines, llama_dir)
    assert code == 1 and set(bodies) == {"plain", "pen", "bias", "min"}
    [error] = [e["error"] for e in errors]
    assert (error["code"], error["param"], error["line"]) == ("invalid_value", "body.logit_bias", 5)
    assert f"token id {vocab}, outside the model's vocabulary [0, {vocab})" in error["message"]
    expected = {
        "plain": reference.generate("The zen of", greedy(8))[0],
        "pen": reference.generate("The zen of", greedy(8, **penalties))[0],
        "bias": reference.chat([{"role": "user", "content": "Hello there"}],
                               greedy(6, logit_bias={40: 5, eos: -100}))[0],
        "min": reference.generate("The zen of", greedy(6, min_tokens=4, logit_bias={eos: 100}))[0],
    }
    for custom_id, want in expected.items():
        choice = bodies[custom_id]["choices"][0]
        assert (choice["message"]["content"] if custom_id == "bias" else choice["text"]) == want.text
        assert bodies[custom_id]["usage"]["completion_tokens"] == len(want.token_ids)
    assert want.finish_reason == "stop" and len(want.token_ids) == 5  # min: EOS as soon as min_tokens allow
    assert expected["pen"].token_ids != expected["plain"].token_ids
    assert 40 in expected["bias"].token_ids


def test_a_chat_template_that_fails_is_an_error_line_per_chat_request(tmp_path, llama_dir):
    """A template is code shipped with the model: any exception in it (here a TypeError, which is no Jinja
    TemplateError) fails its lines with invalid_prompt, as vLLM answers 400, and the other lines still run."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text("{{ messages | length + ' messages' }}")
    code, bodies, errors = sluice_run(tmp_path / "run", [chat("c", max_tokens=2), completion("p", max_tokens=2)],
                                      model)
    assert (code, set(bodies)) == (1, {"p"})
    [error] = [e["error"] for e in errors]
    assert (error["code"], error["param"], error["line"]) == ("invalid_prompt", "body.messages", 1)
    assert "the chat template failed" in error["message"] and "unsupported operand" in error["message"]


def test_resume_after_a_kill_runs_each_request_once(tmp_path, llama_dir, monkeypatch, capsys):
    lines = [completion(f"r{i}", f"prompt number {i}", max_tokens=4, temperature=0) for i in range(6)]
    code, full, _ = sluice_run(tmp_path / "full", lines, llama_dir)
    assert code == 0
    finished = (tmp_path / "full" / "out.jsonl").read_text().splitlines(keepends=True)
    killed = tmp_path / "resume" / "out.jsonl"
    killed.parent.mkdir()
    killed.write_text(finished[0] + finished[1] + finished[2][:40])
    submitted = []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request",
                        lambda self, prompt, params=None, request_id=None, **kw:
                        submitted.append(request_id) or add_request(self, prompt, params, request_id, **kw))
    code, bodies, errors = sluice_run(tmp_path / "resume", lines, llama_dir)
    assert (code, errors) == (0, [])
    assert "2 already in" in capsys.readouterr().err
    kept = {json.loads(line)["custom_id"] for line in finished[:2]}
    assert sorted(submitted) == sorted({f"r{i}" for i in range(6)} - kept)
    resumed = killed.read_text().splitlines(keepends=True)
    assert resumed[:2] == finished[:2]
    assert sorted(json.loads(line)["custom_id"] for line in resumed) == [f"r{i}" for i in range(6)]
    assert {k: b["choices"][0]["text"] for k, b in bodies.items()} == {
        k: b["choices"][0]["text"] for k, b in full.items()}


def test_resume_refuses_an_output_file_it_did_not_write(tmp_path, llama_dir, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("hello\nworld\n")
    code = main(["run", str(write_jsonl(tmp_path / "in.jsonl", [completion("a")])), "-o", str(out),
                 "--model", str(llama_dir)])
    assert code == 2 and "line 1 is not an output line" in capsys.readouterr().err
    assert out.read_text() == "hello\nworld\n"


def test_stop_string_is_honoured(tmp_path, llama_dir, reference):
    text = reference.generate("Errors should never", greedy(24))[0].text
    stop = text[8:11]
    lines = [completion("s", "Errors should never", max_tokens=24, temperature=0, stop=stop),
             completion("l", "Errors should never", max_tokens=24, temperature=0, stop=[stop, "\u2603"])]
    code, bodies, _ = sluice_run(tmp_path, lines, llama_dir)
    assert code == 0
    for body in bodies.values():
        assert body["choices"][0]["text"] == text[:text.find(stop)]
        assert body["choices"][0]["finish_reason"] == "stop"


def test_logprobs_in_openai_shapes(tmp_path, llama_dir, reference):
    lines = [chat("c", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3),
             chat("c0", max_tokens=2, temperature=0, logprobs=True),
             completion("p", max_tokens=5, temperature=0, logprobs=2)]
    code, bodies, _ = sluice_run(tmp_path, lines, llama_dir, "--served-model-name", "tiny")
    assert code == 0 and {b["model"] for b in bodies.values()} == {"tiny"}
    want = reference.chat([{"role": "user", "content": "Hello there"}], greedy(5, logprobs=3))[0]
    content = bodies["c"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry, lp in zip(content, want.logprobs):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert entry["token"] == reference.tokenizer.decode([lp.token_id])
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"]  # a character part: U+FFFD
        assert [t["token"] for t in entry["top_logprobs"]] == [reference.tokenizer.decode([t]) for t, _ in lp.top]
    assert all(e["top_logprobs"] == [] for e in bodies["c0"]["choices"][0]["logprobs"]["content"])
    logprobs = bodies["p"]["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(logprobs[k]) == 5 for k in logprobs)
    assert all(len(top) <= 2 and isinstance(top, dict) for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])


def test_the_engine_is_fed_a_bounded_queue(tmp_path, llama_dir, monkeypatch):
    held = []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request",
                        lambda self, *args, **kw: held.append(len(self.requests)) or add_request(self, *args, **kw))
    lines = [completion(f"q{i}", max_tokens=2, temperature=0) for i in range(12)]
    code, bodies, _ = sluice_run(tmp_path, lines, llama_dir, "--max-num-seqs", "1")
    assert code == 0 and len(bodies) == 12
    assert max(held) == QUEUE_DEPTH - 1


def test_demo_model_runs_on_a_fresh_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, bodies, errors = sluice_run(tmp_path, [chat("d", max_tokens=3), completion("e", max_tokens=3)], "demo")
    assert (code, errors) == (0, [])
    assert {b["model"] for b in bodies.values()} == {"demo"}
    assert (tmp_path / "cache" / "sluice").is_dir()


@pytest.mark.parametrize("problem, args, message", [
    ("missing input", ["run", "{tmp}/nope.jsonl", "-o", "{tmp}/o.jsonl", "--model", "demo"], "input file"),
    ("bad model dir", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/o.jsonl", "--model", "{tmp}/none"],
     "model directory"),
    ("not a checkpoint", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/o.jsonl", "--model", "{tmp}"], "config.json"),
    ("output is input", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl", "--model", "demo"], "is the input file"),
    ("bad dtype", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/o.jsonl", "--model", "{llama}", "--dtype", "int3"],
     "dtype must be"),
    ("output is a directory", ["run", "{tmp}/in.jsonl", "-o", "{tmp}", "--model", "demo"], "is a directory"),
    ("errors is a directory", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/o.jsonl", "--errors", "{tmp}", "--model", "demo"],
     "is a directory"),
    ("config value of the wrong type", ["run", "{tmp}/in.jsonl", "-o", "{tmp}/o.jsonl", "--model", "{tmp}/m"],
     "/m: config.json: Validation error for field 'hidden_size'"),
])
def test_usage_errors_exit_2_with_a_message(tmp_path, llama_dir, capsys, problem, args, message):
    write_jsonl(tmp_path / "in.jsonl", [completion("a")])
    (tmp_path / "m").mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    code = main([a.format(tmp=tmp_path, llama=llama_dir) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, problem


def test_an_unwritable_output_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sluice.worker.cli.common.os.access", lambda path, mode: False)  # as root, chmod would not do
    monkeypatch.setattr(LLMEngine, "__init__", lambda *a, **kw: pytest.fail("the model was loaded"))
    code = main(["run", str(write_jsonl(tmp_path / "in.jsonl", [completion("a")])), "-o", str(tmp_path / "o.jsonl"),
                 "--model", "demo"])
    assert code == 2 and capsys.readouterr().err == f"sluice run: {tmp_path / 'o.jsonl'}: Permission denied\n"


def test_ctrl_c_while_the_model_loads_exits_130_quietly(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(LLMEngine, "__init__", interrupted)
    code = main(["run", str(write_jsonl(tmp_path / "in.jsonl", [completion("a")])), "-o", str(tmp_path / "o.jsonl"),
                 "--model", "demo"])
    assert code == 130 and capsys.readouterr().err == "\nsluice run: interrupted\n"


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_results(tmp_path, llama_dir, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", max_tokens=2), "{oops"])
    out = tmp_path / "out.jsonl"
    code = main(["run", str(source), "-o", str(out), "--errors", "/dev/full", "--model", str(llama_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "sluice run: /dev/full: No space left on device; finished results are in" in err
    assert "Traceback" not in err and finished_ids(out) <= {"a"}


def test_installed_console_script(tmp_path, llama_dir):
    sluice = Path(sys.executable).with_name("sluice")
    source = write_jsonl(tmp_path / "in.jsonl", [completion("ok", max_tokens=3, temperature=0), "{oops"])
    out, errors = tmp_path / "out.jsonl", tmp_path / "bad.jsonl"
    proc = subprocess.run([str(sluice), "run", str(source), "-o", str(out), "--errors", str(errors),
                           "--model", str(llama_dir)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "output tok/s" in proc.stderr
    assert "1 succeeded, 1 failed" in proc.stderr
    assert [r["custom_id"] for r in read_jsonl(out)] == ["ok"]
    assert read_jsonl(errors)[0]["error"]["line"] == 2


def test_python_dash_m_sluice_runs_from_the_checkouts_root(tmp_path, llama_dir):
    """`python -m sluice` puts its working directory on sys.path; run in the repository's root (whose kernels/ has the
    name of the Hub's package that transformers imports), the engine still loads."""
    root = Path(__file__).resolve().parents[2]
    source = write_jsonl(tmp_path / "in.jsonl", [completion("ok", max_tokens=3, temperature=0)])
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "sluice", "run", str(source), "-o", str(out), "--model",
                           str(llama_dir)], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    assert [r["custom_id"] for r in read_jsonl(out)] == ["ok"]


def test_finished_ids_keep_a_complete_last_line_and_drop_a_cut_one(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}')
    assert finished_ids(out) == {"a", "b"} and out.read_text().endswith('"b"}\n')
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b", "resp')
    assert finished_ids(out) == {"a"} and out.read_text() == '{"custom_id": "a"}\n'
