"""bench/gpu_check.py stays runnable without a GPU: a clear refusal, and a smoke run of all its code paths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


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
