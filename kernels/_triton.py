"""Imports Triton when installed (else stand-ins, so the *_ref functions import anywhere) and launch helpers."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only host without the gpu extra: references work, launching a kernel says why not
    from types import SimpleNamespace

    class _MissingTriton:
        def __init__(self, fn):
            self.name = fn.__name__

        def __getitem__(self, grid):
            raise ModuleNotFoundError(f"{self.name} needs triton: install sluice[gpu]")

    triton = SimpleNamespace(jit=_MissingTriton)
    tl = SimpleNamespace(constexpr=None)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 models get exact products (tf32 would drift from the reference); half dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else None
