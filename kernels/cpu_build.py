"""Builds a C++ CPU kernel (csrc/) on first use with PyTorch's C++ extension loader, cached per source, flags and
CPU under ~/.cache/torch_extensions; None, with a warning logged once, where it cannot be built."""

from __future__ import annotations

import hashlib
import logging
import platform
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
# -march=native: the build is for this machine's vector units; its CPU is part of the build's name, so a cache
# directory shared between machines never hands one a build for another's. OpenMP: ATen's parallel_for, on the
# libgomp torch already loaded (without it ATen's `#pragma omp parallel` is ignored and one thread does it all).
FLAGS = ("-O3", "-march=native", "-fopenmp")


def _cpu_signature() -> str:
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu = ""
    return cpu + platform.machine() + platform.processor()


@cache
def build(source: str, extra_flags: tuple[str, ...] = ()):
    """The compiled module of csrc/`source`, or None where it cannot be built (no compiler, not Linux/x86/ARM)."""
    from torch.utils.cpp_extension import load

    path = CSRC / source
    flags = [*FLAGS, *extra_flags]
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(path.read_bytes() + headers + " ".join(flags).encode() + _cpu_signature().encode())
    try:
        return load(f"sluice_{path.stem}_{digest.hexdigest()[:12]}", [str(path)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"])
    except Exception as e:  # a C++ toolchain is optional: the callers fall back to PyTorch ops
        log.warning("the C++ CPU kernels of %s could not be built (%s); using PyTorch ops instead", source, e)
        return None
