"""The dependency rule, checked: API hosts and the CPU worker never load the GPU stack."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("modules", [
    # an API host
    "sluice.api.results, sluice.api.store, sluice.api.server, sluice.api.client, sluice.api.webhooks, sluice.api.queue",
    "sluice.worker.celery_app, sluice.worker.tasks, sluice.worker.reconcile",  # the webhooks and maintenance worker
    "sluice.worker.cli",  # `sluice --help`
])
def test_no_torch(modules):
    code = f"import sys, {modules}; from sluice.worker.cli import build_parser; build_parser(); " \
           "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cpu_engine_never_imports_triton(llama_dir):
    """Triton is for the CUDA kernels: a CPU engine (a CPU host's worker engine process, `sluice run`) loads, steps and
    finishes requests without importing it, which cost time at every engine start (kernels/checks.py)."""
    code = ("import sys; from sluice import LLM, SamplingParams; "
            f"llm = LLM({str(llama_dir)!r}, max_num_seqs=4); "
            "out = llm.generate(['hello there', 'bye'], SamplingParams(max_tokens=4, ignore_eos=True)); "
            "assert [len(o.token_ids) for o in out] == [4, 4], out; "
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))[:3]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_facade_loads_the_engine_only_when_asked():
    """`import sluice` and `from sluice import Client` load no torch; the engine's names load it on first use."""
    code = ("import sys, sluice; from sluice import Client, SluiceError; "
            "assert 'torch' not in sys.modules, 'torch imported by the client'; "
            "assert {'Client', 'LLM', 'SamplingParams'} <= set(dir(sluice)); "
            "assert Client.__module__ == 'sluice.api.client'; "
            "from sluice import SamplingParams; assert 'torch' in sys.modules; "
            "import sluice.worker.engine as engine; assert SamplingParams is engine.SamplingParams; "
            "assert sluice.LLM is engine.LLM and sluice.RequestOutput is engine.RequestOutput\n"
            "try:\n    sluice.Nothing\nexcept AttributeError as e:\n    assert 'Nothing' in str(e)\n"
            "else:\n    raise AssertionError('no AttributeError')")
    subprocess.run([sys.executable, "-c", code], check=True)
