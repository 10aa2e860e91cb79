"""Builds a C++ CPU kernel (csrc/) on first use with PyTorch's C++ extension loader, under a name that says everything
the binary depends on, so one build serves every install alike; None, with a warning logged once, where it cannot be
built."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

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


def _torch_signature() -> str:
    """The torch whose headers the binary compiles against and whose libraries it links: one build of one version."""
    import torch

    return f"{torch.__version__} {torch.version.git_version} cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _python_signature() -> str:
    """The interpreter whose C API the binary calls: e.g. cpython-3.11, and 't' after it for a free-threaded build."""
    version = ".".join(map(str, sys.version_info[:2]))
    return f"{sys.implementation.name}-{version}{getattr(sys, 'abiflags', '')}"


def build_inputs(source: str, extra_flags: tuple[str, ...] = ()) -> dict[str, str]:
    """What the binary depends on: files by content, never by path, and nothing that differs between two venvs with
    the same torch, so those share one build and venvs with another torch or Python keep their own."""
    files = [CSRC / source, *sorted(CSRC.glob("*.h"))]  # the headers: what the sources include
    return {
        **{f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "flags": " ".join([*FLAGS, *extra_flags]),
        "cpu": _cpu_signature(),
        "torch": _torch_signature(),
        "python": _python_signature(),
    }


def extension_name(source: str, extra_flags: tuple[str, ...] = ()) -> str:
    """The build's name, and its directory's: one per set of build_inputs."""
    digest = hashlib.sha256(json.dumps(build_inputs(source, extra_flags), sort_keys=True).encode())
    return f"sluice_{Path(source).stem}_{digest.hexdigest()[:12]}"


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


def _load_built(library: Path) -> ModuleType | None:
    """The library a finished build left, loaded directly: torch's loader would rewrite build.ninja with this install's
    paths (its sources, its venv's torch headers) and ninja rebuilds whenever a command line changes, so venvs sharing
    a build would take turns rebuilding it. Its name already vouches for what is inside."""
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(library.stem, library)
    try:
        module = importlib.util.module_from_spec(spec)  # dlopen()s it
        spec.loader.exec_module(module)
    except ImportError as e:  # a link killed midway leaves a truncated library: build it again
        log.warning("rebuilding %s, which does not load (%s)", library, e)
        library.unlink()
        return None
    return module


def _say(line: str) -> None:
    """To stderr, whether or not logging is configured: `sluice run` users see why their first start pauses."""
    print(f"sluice: {line}", file=sys.stderr, flush=True)


def _compile(name: str, source: str, extra_flags: tuple[str, ...], build_dir: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    _say(f"compiling the C++ CPU kernels of {source}, which run the CPU engine faster than PyTorch ops, for this CPU, "
         "torch and Python: about 25-60 s, once per machine and torch version")
    start = time.monotonic()
    module = load(name, [str(CSRC / source)], extra_cflags=[*FLAGS, *extra_flags], extra_ldflags=["-fopenmp"],
                  build_directory=str(build_dir))
    _say(f"compiled {source} in {time.monotonic() - start:.0f} s; later starts load it from {build_dir}")
    return module


@cache
def build(source: str, extra_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module of csrc/`source`, or None where it cannot be built (no compiler, not Linux/x86/ARM)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        name = extension_name(source, extra_flags)  # inside: a sources-less install falls back too
        build_dir = Path(_get_build_directory(name, verbose=False))  # TORCH_EXTENSIONS_DIR or torch's default
        with _exclusive(build_dir):
            return _load_built(build_dir / f"{name}.so") or _compile(name, source, extra_flags, build_dir)
    except Exception as e:  # a C++ toolchain is optional: the callers fall back to PyTorch ops
        log.warning("the C++ CPU kernels of %s could not be built (%s); using PyTorch ops instead", source, e)
        return None


def dtypes(module: ModuleType | None) -> tuple:
    """The torch dtypes a built kernel module takes (csrc/dispatch.h): none where it could not be built; float16
    only where the compiler had _Float16."""
    import torch

    if module is None:
        return ()
    return (torch.float32, torch.bfloat16) + ((torch.float16,) if module.half else ())
