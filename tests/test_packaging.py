"""The wheel `pip install .` makes (the Docker image's install, not the tests' editable one): one import name,
`sluice`, holding every file of the repository's package folders (the C++ kernel sources a CPU engine compiles, the
migrations `sluice db upgrade` applies); installed without extras, the client and the CLI work without torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from sluice.worker.cli.common import ENGINE_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"sluice": "sluice", "api": "sluice/api", "worker": "sluice/worker", "kernels": "sluice/kernels",
           "migrations": "sluice/migrations"}  # a folder of the repository -> where the wheel puts it
needs_setuptools_77 = pytest.mark.skipif(int(version("setuptools").split(".")[0]) < 77,
                                         reason="the build needs setuptools>=77")


def _source_files() -> set[str]:
    """Every file of the package folders, named by its place in the wheel."""
    return {f"{FOLDERS[folder]}/{path.relative_to(ROOT / folder).as_posix()}" for folder in FOLDERS
            for path in (ROOT / folder).rglob("*") if path.is_file() and "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"  # a copy, so the build leaves no build/ or egg-info in the checkout
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp / "dist"), str(tree)], check=True, timeout=300)
    [built] = (tmp / "dist").glob("sluice-*.whl")
    return built


@needs_setuptools_77
def test_the_wheel_is_one_sluice_package_holding_every_file(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {"sluice", f"{wheel.name.split('-py')[0]}.dist-info"}
    packed = set(names)
    assert _source_files() - packed == set()
    assert {"sluice/kernels/csrc/paged_decode_cpu.cpp", "sluice/migrations/versions/0001_initial_schema.py",
            "sluice/migrations/alembic.ini", "sluice/worker/cli/__init__.py"} <= packed


@needs_setuptools_77
def test_the_wheel_without_extras_gives_the_client_and_cli_without_torch(wheel, tmp_path):
    """A fresh virtualenv, the wheel and its own dependencies only (from pip's cache or the package index): the client
    imports, `sluice --help` prints, and torch is not there to be imported at all."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=600, env=env)
    check = ("import importlib.util, sys; from sluice import Client; import sluice.api.server; "
             "assert importlib.util.find_spec('torch') is None; assert 'torch' not in sys.modules; print(Client)")
    done = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "sluice.api.client.Client" in done.stdout, done.stderr
    helped = subprocess.run([venv / "bin" / "sluice", "--help"], capture_output=True, text=True, timeout=120, env=env,
                            cwd=tmp_path)
    assert helped.returncode == 0 and "submit" in helped.stdout and "serve" in helped.stdout, helped.stderr


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
            f"from sluice.worker.cli import main; sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"sluice {command[0]}: this command runs the engine, which needs torch, "
                                   "transformers: pip install 'sluice[engine]' (on a GPU host 'sluice[gpu]')")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "data").exists()
