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
    # Qwen3: q/k norms and a head_dim other than hidden / heads; "qwen3" slides layer 1, the tied one has q/k/v/o
    # biases (initializer_range 0.1: attention far enough from uniform that rope and the norms decide tokens)
    "qwen3": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, use_sliding_window=True, sliding_window=16,
                                       max_window_layers=1, initializer_range=0.1)),
    "qwen3_tied": ("Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                                            attention_bias=True, initializer_range=0.1)),
    # Phi3: fused qkv/gate_up tensors, rope over half of each head, a window of 16; LongRoPE past 64 positions
    "phi3": ("Phi3ForCausalLM", dict(num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=16,
                                     initializer_range=0.1)),
    "phi3_longrope": ("Phi3ForCausalLM", dict(
        num_key_value_heads=1, max_position_embeddings=256, original_max_position_embeddings=64, initializer_range=0.1,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
                      "long_factor": [1.0, 1.3, 1.8, 2.6, 3.7, 5.2, 7.4, 10.0]})),
    # mixture of experts, top-2: Mixtral renormalises the two weights; Qwen3-MoE here does not (norm_topk_prob
    # off), has q/k norms and a dense MLP in layer 1 (mlp_only_layers). Weights drawn 5x wider than the default
    # (initializer_range): the experts' outputs then move the logits enough that a wrong weight changes tokens
    "mixtral": ("MixtralForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                           num_experts_per_tok=2, initializer_range=0.1)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
                                              mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=False,
                                              initializer_range=0.1)),
    # Gemma: windows of 8 that prompts cross, query_pre_attn_scalar != head_dim; Gemma 2 with caps small enough to
    # bite, Gemma 3 with a linearly scaled global rope beside its local one (layer 0 slides, layer 1 is global)
    "gemma2": ("Gemma2ForCausalLM", dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                         initializer_range=0.1, attn_logit_softcapping=1.0,
                                         final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
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
