"""Every kernel specialization the launchers use compiles for an H200 (sm_90), checked here without a GPU."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without CUDA backend")
def test_kernels_compile_for_h200():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter skips compilation
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(HERE / "compile_for_h200.py")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
