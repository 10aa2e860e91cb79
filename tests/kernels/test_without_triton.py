"""The kernel modules import without Triton (CPU-only hosts use the references); launching says what is missing."""

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError, as on a host without it
import torch
from sluice.kernels.quant import quantize_int8
from sluice.kernels.w8a16 import w8a16_matmul, w8a16_matmul_ref
import sluice.kernels.decode_attention, sluice.kernels.prefill_attention, sluice.kernels.kv_store, sluice.kernels.w4a16
x, (qweight, scale) = torch.randn(2, 32), quantize_int8(torch.randn(4, 32))
assert w8a16_matmul_ref(x, qweight, scale).shape == (2, 4)
try:
    w8a16_matmul(x, qweight, scale)
except ModuleNotFoundError as e:
    assert "triton" in str(e)
else:
    raise AssertionError("launch without triton did not fail")
"""


def test_references_import_and_run_without_triton():
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, check=True, timeout=120)
