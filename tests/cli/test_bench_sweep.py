"""`sluice bench sweep`: a tiny sweep end to end (table, sweep.json, sweep.png) and the knee rule."""

from __future__ import annotations

import json

import pytest

from sluice.worker.cli import main
from sluice.worker.sweep import SweepRow, find_knee

ROW_KEYS = {"max_num_seqs", "output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p95_s", "latency_p50_s",
            "latency_p95_s", "mean_kv_use", "num_preemptions", "knee"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(cap: int, throughput: float) -> SweepRow:
    return SweepRow(cap, 10, 0, 1.0, 100, throughput, 10.0, 0.1, 0.2, 0.5, 0.9, 0.5, 0)


@pytest.mark.parametrize("throughputs,knee", [
    ([100, 380, 400, 390, 410], 16),  # best 410: 95% is 389.5, first reached at 16 (400)
    ([100, 389, 400, 390, 410], 16),  # 389 falls just short
    ([100, 390, 400, 380, 410], 4),  # 390 is within 5%, whatever follows
    ([100, 200, 300, 400, 500], 64),  # still climbing: the largest cap
    ([500, 100, 100, 100, 100], 1),  # the smallest is the best
])
def test_knee_rule(throughputs, knee):
    rows = [row(cap, t) for cap, t in zip([1, 4, 16, 32, 64], throughputs)]
    assert find_knee(rows) == knee


def sweep(tmp_path, model, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "sweep"
    code = main(["bench", "sweep", "--model", str(model), "--output-dir", str(out), *flags])
    return code, json.loads((out / "sweep.json").read_text()) if code == 0 else {}


def test_synthetic_sweep(tmp_path, llama_dir, capsys):
    code, report = sweep(tmp_path, llama_dir, "--num-requests", "6", "--prompt-tokens", "4-12", "--output-tokens",
                         "2-5", "--max-num-seqs", "8,1,2")
    assert code == 0
    rows = report["rows"]
    assert [r["max_num_seqs"] for r in rows] == [1, 2, 8]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["num_requests"] == 6 and r["failed"] == 0
        assert 6 * 2 <= r["output_tokens"] <= 6 * 5  # eos ignored: each request generates its drawn length
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["latency_p95_s"]
        assert r["latency_p50_s"] <= r["latency_p95_s"]
        assert 0 < r["mean_kv_use"] <= 1
    assert len({r["output_tokens"] for r in rows}) == 1  # the same workload at every cap
    best = max(r["output_tokens_per_s"] for r in rows)
    expected = min(r["max_num_seqs"] for r in rows if r["output_tokens_per_s"] >= 0.95 * best)
    assert report["knee"] == expected
    assert [r["max_num_seqs"] for r in rows if r["knee"]] == [expected]
    assert report["workload"]["num_requests"] == 6
    png = (tmp_path / "sweep" / "sweep.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    import matplotlib.pyplot as plt

    assert plt.imread(tmp_path / "sweep" / "sweep.png").shape[2] in (3, 4)  # a whole image, decodable
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].split()[:3] == ["max_num_seqs", "out", "tok/s"]
    assert [line.split()[0] for line in table[1:]] == ["1", "2", "8"]
    assert [line.endswith("<- knee") for line in table[1:]] == [r["knee"] for r in rows]
    assert "max_num_seqs 8" in captured.err  # the progress bar names the cap it is on


def test_one_cap_queues_past_it(tmp_path, llama_dir):
    """At cap 1 requests run one after another: the last waits for all the others, so its first token comes long
    after the first request's."""
    code, report = sweep(tmp_path, llama_dir, "--num-requests", "4", "--prompt-tokens", "8", "--output-tokens", "6",
                         "--max-num-seqs", "1")
    (only,) = report["rows"]
    assert code == 0 and only["knee"] and report["knee"] == 1
    assert only["output_tokens"] == 4 * 6
    assert only["ttft_p95_s"] > only["ttft_p50_s"]


def test_input_sweep(tmp_path, llama_dir):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "The zen of Python " * (i + 1), "max_tokens": 3, "ignore_eos": True}}
             for i in range(5)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"custom_id": "bad"}\n')
    code, report = sweep(tmp_path, llama_dir, "--input", str(source), "--max-num-seqs", "2,4")
    assert code == 0
    assert report["workload"]["skipped_lines"] == 1 and report["workload"]["num_requests"] == 5
    assert [(r["num_requests"], r["output_tokens"]) for r in report["rows"]] == [(5, 15), (5, 15)]


@pytest.mark.parametrize("flags,message", [
    (["--input", "x.jsonl", "--num-requests", "3"], "not both"),
    (["--num-requests", "3", "--prompt-tokens", "4"], "--output-tokens C-D"),
    (["--num-requests", "3", "--prompt-tokens", "4", "--output-tokens", "3000"], "at most"),
])
def test_usage_errors(tmp_path, llama_dir, capsys, flags, message):
    assert main(["bench", "sweep", "--model", str(llama_dir), "--output-dir", str(tmp_path / "o"), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--max-num-seqs", "0,4"], ["--max-num-seqs", "4,x"], ["--prompt-tokens", "9-3"]])
def test_bad_lists_and_ranges(tmp_path, llama_dir, capsys, flags):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sweep", "--model", str(llama_dir), "--output-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
