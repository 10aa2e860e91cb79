"""The wheel `pip install .` makes (the Docker image's install, not the tests' editable one) holds every file of the
packages: the C++ kernel sources a CPU engine compiles and the migrations `sluice db upgrade` applies."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from worker.cli import ENGINE_PACKAGES

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


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_an_api_host_installs_no_engine():
    """`pip install sluice` (an API host, the webhooks worker, the client) takes no torch or transformers: the engine's
    packages are the `engine` extra, which `gpu` and `test` include, and the CLI names exactly those when missing."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    engine = {_requirement_name(r) for r in extras["engine"]}
    assert engine == set(ENGINE_PACKAGES)
    assert engine.isdisjoint(_requirement_name(r) for r in project["dependencies"])
    assert "sluice[engine]" in extras["gpu"] and "sluice[engine]" in extras["test"]


@pytest.mark.parametrize("command", [
    ["run", "{input}", "-o", "{tmp}/out.jsonl", "--model", "demo"],
    ["worker", "--model", "demo"],
    ["serve", "--model", "demo", "--data-dir", "{tmp}/data"],
])
def test_engine_commands_without_the_engine_say_what_to_install(tmp_path, command):
    """Where torch is not installed (sys.modules' None entry is how Python blocks an import), `sluice run`, `worker`
    and `serve` stop with one line naming the missing packages and the install command, before touching anything."""
    (tmp_path / "in.jsonl").write_text("{}\n")
    argv = [arg.format(input=tmp_path / "in.jsonl", tmp=tmp_path) for arg in command]
    code = ("import sys; sys.modules.update(dict.fromkeys(['torch', 'transformers'])); "
            f"from worker.cli import main; sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"sluice {command[0]}: this command runs the engine, which needs torch, "
                                   "transformers: pip install 'sluice[engine]' (on a GPU host 'sluice[gpu]')")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "data").exists()
