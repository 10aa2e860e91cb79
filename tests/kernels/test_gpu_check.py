"""bench/gpu_check.py stays runnable without a GPU: a clear refusal, and a smoke run of all its code paths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_says_so(capsys):
    assert load().main([]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_smoke_run_checks_every_kernel_and_the_engine(capsys):
    assert load().main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for name in ("store_kv int8 KV V scale", "decode attention int8 KV", "prefill attention", "W8A16 M=17",
                 "W4A16 M=1", "engine, random toy-shaped model"):
        assert name in out
    assert "MISMATCH" not in out


class FakeTime:
    """gpu_check's clock: one second per engine step (the wrapped step advances it)."""

    def __init__(self):
        self.now = 0.0
        self.read: list[float] = []

    def perf_counter(self) -> float:
        self.read.append(self.now)
        return self.now


def test_decode_rate_times_the_whole_batch(monkeypatch):
    """A batch whose prefill takes many steps (its first sequences decode meanwhile) still decodes whole through
    every timed step, and the rate counts the tokens those steps generated."""
    import dataclasses

    from sluice.worker.engine import LLM

    gpu_check = load()
    s = dataclasses.replace(gpu_check.SMOKE, engine_prompt=24, engine_steps=4)
    llm = LLM(str(gpu_check.model_dir(gpu_check.TINY)), load_format="dummy", dtype="float32", device="cpu",
              max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=64)
    clock, generated = FakeTime(), []
    step = llm.step

    def timed_step(*args):
        out = step(*args)
        generated.append((clock.now, llm.last_step.num_generated if llm.last_step else 0))
        clock.now += 1
        return out

    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(llm, "step", timed_step)
    rate, _ = gpu_check.decode_rate(llm, 8, s, "cpu")
    start, end = clock.read[0], clock.read[-1]
    assert end - start == s.engine_steps
    assert [n for t, n in generated if start <= t < end] == [8] * s.engine_steps
    assert rate == 8
    assert not llm.has_unfinished_requests()


def test_a_failing_check_still_lets_the_others_run(monkeypatch, capsys):
    gpu_check = load()

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(gpu_check, "check_decode", broken)
    assert gpu_check.main(["--smoke", "--skip-engine"]) == 1
    captured = capsys.readouterr()
    assert "RuntimeError: planted" in captured.err
    assert "broken int8=True ERROR" in captured.out and "W4A16 M=17" in captured.out
