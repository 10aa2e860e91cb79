"""Builds a C++ CPU kernel (csrc/) on first use with PyTorch's C++ extension loader, cached per source, flags and
CPU under ~/.cache/torch_extensions; None, with a warning logged once, where it cannot be built."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
from collections.abc import Iterator
from contextlib import contextmanager
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


def extension_name(source: str, extra_flags: tuple[str, ...] = ()) -> str:
    """The build's name: one per source, headers, flags and CPU."""
    path = CSRC / source
    flags = [*FLAGS, *extra_flags]
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(path.read_bytes() + headers + " ".join(flags).encode() + _cpu_signature().encode())
    return f"sluice_{path.stem}_{digest.hexdigest()[:12]}"


@contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """Serialises sluice's builds in build_dir across processes. torch's own lock is a file (`lock`) that a build
    killed midway leaves behind, and every later load then waits on it forever; a flock dies with its holder, so
    while it is held no sluice process is building and a leftover `lock` is stale."""
    with open(build_dir / "sluice.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield  # closing f releases the flock


@cache
def build(source: str, extra_flags: tuple[str, ...] = ()):
    """The compiled module of csrc/`source`, or None where it cannot be built (no compiler, not Linux/x86/ARM)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    try:
        name = extension_name(source, extra_flags)  # inside: a sources-less install falls back too
        build_dir = Path(_get_build_directory(name, verbose=False))  # TORCH_EXTENSIONS_DIR or torch's default
        with _exclusive(build_dir):
            return load(name, [str(CSRC / source)], extra_cflags=[*FLAGS, *extra_flags], extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir))
    except Exception as e:  # a C++ toolchain is optional: the callers fall back to PyTorch ops
        log.warning("the C++ CPU kernels of %s could not be built (%s); using PyTorch ops instead", source, e)
        return None
