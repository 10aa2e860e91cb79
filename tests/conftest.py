"""Shared fixtures: tiny random Llama, Mistral and Qwen2 checkpoints built with transformers once per test run."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

# The repository's root holds kernels/, the name of the Hub's `kernels` distribution that transformers imports:
# with the root on sys.path (`python -m pytest`, or a child's `python -c`/`-m` run there) ours would shadow it. Tests
# import only `sluice.` names, which the install maps onto these folders, so neither this process nor its children
# need the root on their path.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"  # children: no script directory or working directory prepended (Python 3.11+)

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads this when kernels are first decorated: without a GPU they run in its interpreter, on the CPU
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """Build the C++ CPU kernels once, first (slow on a new machine, then cached): the worker and server
    processes that tests start would otherwise each build them inside their start-up timeouts."""
    from sluice.kernels import cpu_attention, cpu_layers

    cpu_attention.available()
    cpu_layers.available()


@pytest.fixture(autouse=True)
def thawed_heap():
    """A worker started in this process (tests/worker) freezes its heap (freeze_heap, worker/engine_process.py), and
    frozen objects are never collected, not even as the interpreter exits: Triton's, imported when the kernel tests
    were collected, would then outlive nanobind's exit-time check, which prints hundreds of lines of 'leaks' after
    pytest's summary. Later tests would also run with the worker's collection threshold. Both are undone here."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


ARCHS = {
    # GQA in every model (4 query heads share 2 or 1 KV heads); Qwen2 adds q/k/v bias and tied embeddings
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # a window shorter than most prompts: attention sees only the last 16 positions
    "mistral_window": ("MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=16)),
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from sluice.worker.engine.demo import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_dir):
    """name -> checkpoint dir, built lazily per architecture."""
    from sluice.worker.engine.demo import build_checkpoint

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            arch, overrides = ARCHS[name]
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), arch, seed=1,
                                           tokenizer_dir=tokenizer_dir, **overrides)
        return built[name]

    return get


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints("llama")


@pytest.fixture
def scripted_tokens(monkeypatch):
    """script(tokens): the engine 'samples' these tokens in order, so a test picks exactly the text generated."""
    def script(tokens: list[int]) -> None:
        queue = iter(tokens)
        monkeypatch.setattr("sluice.worker.engine.llm.sample",
                            lambda logits, seqs, *_: ([next(queue) for _ in seqs], [None] * len(seqs)))

    return script
