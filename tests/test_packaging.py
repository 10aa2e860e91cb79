"""The wheel `pip install .` makes (the Docker image's install, not the tests' editable one) holds every file of the
packages: the C++ kernel sources a CPU engine compiles and the migrations `sluice db upgrade` applies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "worker", "kernels", "migrations")


def _source_files() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


@pytest.mark.skipif(int(version("setuptools").split(".")[0]) < 77, reason="the build needs setuptools>=77")
def test_the_wheel_holds_every_file_of_the_packages(tmp_path):
    tree = tmp_path / "tree"  # a copy, so the build leaves no build/ or egg-info in the checkout
    for name in ("pyproject.toml", "README.md"):
        tree.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tree / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path / "dist"), str(tree)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("sluice-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.split("/")[0] in PACKAGES}
    assert _source_files() - packed == set()
    assert "kernels/csrc/paged_decode_cpu.cpp" in packed and "migrations/versions/0001_initial_schema.py" in packed
