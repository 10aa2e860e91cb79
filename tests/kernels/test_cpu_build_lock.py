"""A C++ kernel build killed midway leaves torch's `lock` file behind; later engine starts must not wait on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sluice.kernels.cpu_build import extension_name

SOURCE, FLAGS = "layers_cpu.cpp", ("-ffp-contract=off",)


def test_a_stale_torch_lock_does_not_hang_the_build(tmp_path):
    from torch.utils.cpp_extension import get_default_build_root

    name = extension_name(SOURCE, FLAGS)
    built = next(Path(get_default_build_root()).glob(f"*/{name}"), None)
    build_dir = tmp_path / name
    if built is not None:  # copied, so that only the load is timed, not a first build (minutes on 2 CPUs)
        shutil.copytree(built, build_dir, ignore=shutil.ignore_patterns("lock", "sluice.flock"))
    build_dir.mkdir(exist_ok=True)
    (build_dir / "lock").touch()  # what SIGTERM during torch's build leaves
    check = f"from sluice.kernels.cpu_build import build; assert build({SOURCE!r}, {FLAGS!r}) is not None"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60 if built else 600,
                   env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert not (build_dir / "lock").exists()


def test_missing_sources_fall_back_to_pytorch_ops(monkeypatch, tmp_path):
    """An install without the C++ sources (a wheel that left them out) must run on PyTorch ops, not crash."""
    from sluice.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "CSRC", tmp_path)
    assert cpu_build.build.__wrapped__(SOURCE, FLAGS) is None
