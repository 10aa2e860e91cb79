"""OpenMP's spin before sleeping, which sluice shortens before torch loads libgomp (sluice/__init__.py), and the
warning a CPU engine gives where torch was imported first."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import sluice
from sluice.worker.engine import LLM

PROBE = "import os, sys, {first}; import torch; print(os.environ.get('GOMP_SPINCOUNT'), sluice.OPENMP_SPIN)"


def _probe(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**clean, **env}, cwd="/",
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(("first", "env", "want"), [
    ("sluice", {}, "10000 10000"),  # set before torch loads libgomp
    ("sluice", {"GOMP_SPINCOUNT": "777"}, "777 777"),  # an explicit setting wins
    ("torch, sluice", {}, "None None"),  # too late: libgomp read its default already
])
def test_the_spin_is_set_before_torch_loads_openmp(first, env, want):
    assert _probe(first, **env) == want


def test_a_cpu_engine_warns_once_when_openmp_kept_its_default_spin(llama_dir, monkeypatch, caplog):
    from sluice.worker.engine import model_runner

    model_runner._warn_default_spin.cache_clear()
    monkeypatch.setattr(sluice, "OPENMP_SPIN", None)
    with caplog.at_level(logging.WARNING):
        LLM(str(llama_dir))
    assert "GOMP_SPINCOUNT=10000" in caplog.text and "torch was imported before sluice" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        LLM(str(llama_dir))
    assert "GOMP_SPINCOUNT" not in caplog.text  # said once a process
    model_runner._warn_default_spin.cache_clear()
    monkeypatch.setattr(sluice, "OPENMP_SPIN", "10000")
    with caplog.at_level(logging.WARNING):
        LLM(str(llama_dir))
    assert "GOMP_SPINCOUNT" not in caplog.text
