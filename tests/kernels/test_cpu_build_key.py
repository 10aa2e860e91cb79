"""The C++ kernels' build name says everything the binary depends on and nothing about where it is installed; a real
compile tells the user so on stderr, and a build already made loads silently from any install."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sluice.kernels import cpu_build

SOURCE, FLAGS = "layers_cpu.cpp", ("-ffp-contract=off",)
# A Python module without torch's headers: it compiles in about a second where the real kernels take 25-60 s
TINY = """
#include <Python.h>
#define JOIN_(a, b) a##b
#define JOIN(a, b) JOIN_(a, b)
#define QUOTE_(a) #a
#define QUOTE(a) QUOTE_(a)
static PyModuleDef tiny = {PyModuleDef_HEAD_INIT, QUOTE(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC JOIN(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""


def _install(monkeypatch, csrc: Path, files: dict[str, str] | None = None) -> Path:
    """Points cpu_build at a copy of the sources in csrc (another install's), plus `files`."""
    shutil.copytree(cpu_build.CSRC, csrc, dirs_exist_ok=True)
    for name, text in (files or {}).items():
        (csrc / name).write_text(text)
    monkeypatch.setattr(cpu_build, "CSRC", csrc)
    return csrc


def test_the_name_is_the_same_for_the_same_inputs_wherever_they_are_installed(monkeypatch, tmp_path):
    here = cpu_build.extension_name(SOURCE, FLAGS)
    _install(monkeypatch, tmp_path / "other-venv" / "site-packages" / "sluice" / "kernels" / "csrc")
    assert cpu_build.extension_name(SOURCE, FLAGS) == here
    assert cpu_build.extension_name(SOURCE) != here  # the flags are part of it


def _append(name: str) -> Callable:
    return lambda monkeypatch, csrc: (csrc / name).write_text((csrc / name).read_text() + "\n// changed\n")


CHANGES = {
    "torch-version": lambda monkeypatch, csrc: monkeypatch.setattr(torch, "__version__", "2.99.0+cpu"),
    "torch-commit": lambda monkeypatch, csrc: monkeypatch.setattr(torch.version, "git_version", "0" * 40),
    "cxx11-abi": lambda monkeypatch, csrc: monkeypatch.setattr(
        torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI),
    "python-version": lambda monkeypatch, csrc: monkeypatch.setattr(sys, "version_info", (3, 99, 0, "final", 0)),
    "free-threaded-python": lambda monkeypatch, csrc: monkeypatch.setattr(sys, "abiflags", "t", raising=False),
    "flags": lambda monkeypatch, csrc: monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-DNDEBUG")),
    "CPU": lambda monkeypatch, csrc: monkeypatch.setattr(cpu_build, "_cpu_signature", lambda: "flags: fpu sse2"),
    "source": _append(SOURCE),
    "header": _append("vec_math.h"),
    "new-header": lambda monkeypatch, csrc: (csrc / "more_math.h").write_text("#pragma once\n"),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=list(CHANGES))
def test_the_name_changes_with_each_input(monkeypatch, tmp_path, change):
    csrc = _install(monkeypatch, tmp_path / "csrc")
    before = cpu_build.extension_name(SOURCE, FLAGS)
    change(monkeypatch, csrc)
    assert cpu_build.extension_name(SOURCE, FLAGS) != before


@pytest.fixture
def extensions_dir(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "torch_extensions"


def test_a_compile_says_what_and_how_long_and_a_built_one_loads_silently_from_another_install(
        monkeypatch, tmp_path, capfd, extensions_dir):
    _install(monkeypatch, tmp_path / "venv-a" / "csrc", {"tiny.cpp": TINY})
    name = cpu_build.extension_name("tiny.cpp")
    assert cpu_build.build.__wrapped__("tiny.cpp").__name__ == name
    start, done = capfd.readouterr().err.splitlines()
    assert start.startswith("sluice: compiling the C++ CPU kernels of tiny.cpp") and "once per machine" in start
    assert done.startswith("sluice: compiled tiny.cpp in ") and done.endswith(str(extensions_dir / name))

    _install(monkeypatch, tmp_path / "venv-b" / "csrc", {"tiny.cpp": TINY})  # same torch, another venv
    assert cpu_build.build.__wrapped__("tiny.cpp").__name__ == name
    assert capfd.readouterr().err == ""


def test_a_library_left_truncated_is_built_again(monkeypatch, tmp_path, capfd, extensions_dir):
    """What a link killed midway leaves: the name exists, the library does not load."""
    _install(monkeypatch, tmp_path / "csrc", {"tiny.cpp": TINY})
    name = cpu_build.extension_name("tiny.cpp", ("-DTRUNCATED",))  # a name this process never loaded
    (extensions_dir / name).mkdir(parents=True)
    (extensions_dir / name / f"{name}.so").write_bytes(b"\x7fELF")
    assert cpu_build.build.__wrapped__("tiny.cpp", ("-DTRUNCATED",)).__name__ == name
    assert "sluice: compiled tiny.cpp" in capfd.readouterr().err
