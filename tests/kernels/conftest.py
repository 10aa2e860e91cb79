"""Runs the kernels on Triton's CPU interpreter when there is no GPU; shared fixtures for the kernel tests."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit runs, i.e. when kernels/ is imported

import pytest  # noqa: E402
from kernel_test_utils import DEVICE, INTERPRETED  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(0)


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def dot_dtype(request) -> torch.dtype:
    """Activation dtypes for kernels built on tl.dot."""
    if request.param == torch.bfloat16 and INTERPRETED:
        pytest.skip("Triton's interpreter computes bf16 tl.dot on raw bits (triton-lang/triton#11584); GPU only")
    return request.param
