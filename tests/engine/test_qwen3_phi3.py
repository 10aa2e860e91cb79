"""Qwen3 and Phi3: greedy tokens equal transformers' generate on tiny random checkpoints (ample cache, preemption,
chunked prefill, prefix-cache hits, the Triton attention kernels), rope tables equal transformers' (LongRoPE, partial
rotary), and config.json read as transformers reads it."""

from __future__ import annotations

import random
import shutil
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_greedy import hf_greedy, make_prompts, run_engine
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.layers import RotaryEmbedding

NUM_PROMPTS = 8
ORIGINAL = 64  # phi3_longrope's original_max_position_embeddings (conftest.ARCHS)
# case -> (checkpoint, engine arguments): transformers switches LongRoPE's factors by a sequence's length, the engine
# by its max_model_len (layers._longrope_inv_freq), so the long case has prompts past 64 and the short one fits in 64
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3_tied", {}),
    "phi3": ("phi3", {}),
    "phi3_longrope_long": ("phi3_longrope", {}),
    "phi3_longrope_short": ("phi3_longrope", {"max_model_len": ORIGINAL}),
}


def randomize_norms(file: Path) -> None:
    tensors = load_file(str(file))
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            tensors[name] = 1 + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(file), metadata={"format": "pt"})


def prompts_for(case: str, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    prompts = make_prompts(vocab, seed)[:NUM_PROMPTS]
    rng = random.Random(seed)
    if case == "phi3_longrope_long":  # every sequence past the pretraining length from its prompt on
        return [([rng.randrange(5, vocab) for _ in range(ORIGINAL + 1)] + ids[:40], n) for ids, n in prompts]
    if case == "phi3_longrope_short":  # every sequence within it to the end
        return [(ids[:ORIGINAL - n], n) for ids, n in prompts]
    return prompts


@pytest.fixture(scope="module")
def checkpoint(checkpoints, tmp_path_factory):
    """name -> a copy of conftest's checkpoint with random RMSNorm weights (transformers initialises them to ones):
    q_norm and k_norm swapped, or one skipped, then changes tokens."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = shutil.copytree(checkpoints(name), tmp_path_factory.mktemp(name), dirs_exist_ok=True)
            randomize_norms(built[name] / "model.safetensors")
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(CASES))
def case(request, checkpoint):
    name, kwargs = CASES[request.param]
    path = checkpoint(name)
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = prompts_for(request.param, vocab, seed=zlib.crc32(request.param.encode()) % 1000)
    return path, prompts, hf_greedy(path, prompts), kwargs


def test_ample_cache(case):
    path, prompts, expected, kwargs = case
    got, stats, planned = run_engine(path, prompts, **kwargs)
    assert got == expected
    assert stats["num_preemptions"] == 0
    assert max(len(step) for step in planned) > 1, "requests were not batched"


def test_preemption_keeps_outputs(case):
    path, prompts, expected, kwargs = case
    got, stats, _ = run_engine(path, prompts, num_kv_blocks=12, **kwargs)
    assert stats["num_preemptions"] > 0
    assert got == expected


def test_chunked_prefill(case):
    path, prompts, expected, kwargs = case
    got, _, planned = run_engine(path, prompts, max_num_batched_tokens=16, **kwargs)
    assert got == expected
    assert all(sum(n for _, n in step) <= 16 for step in planned)
    chunks = Counter(rid for step in planned for rid, n in step if n > 1)
    assert max(chunks.values()) > 1, "no prompt was prefilled over several steps"


@pytest.mark.parametrize("name", ["qwen3", "phi3_longrope"])
def test_shared_prefix_hits_cache(checkpoint, name):
    """Prefixes of 70 tokens: past phi3_longrope's 64, where transformers' factors are the engine's long ones."""
    path = checkpoint(name)
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(str(path)).vocab_size, seed=7, shared_prefix=70)
    prompts = prompts[:6]
    got, stats, _ = run_engine(path, prompts, max_num_seqs=3)
    assert stats["prefix_cache_hits"] >= 3 * 64  # the last three reuse the prefix's four full blocks
    assert got == hf_greedy(path, prompts)


@pytest.mark.parametrize("case_name", ["qwen3_tied", "phi3_longrope_short"])
def test_triton_attention_backend(checkpoint, case_name):
    """The Triton kernels (Triton's interpreter on a CPU; they have no sliding window): head_dim 24 and 16, prefill
    chunks and decode."""
    name, kwargs = CASES[case_name]
    path = checkpoint(name)
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = [(ids[:30], 5) for ids, _ in prompts_for(case_name, vocab, seed=11)[2:5]]
    got, _, _ = run_engine(path, prompts, attention_backend="triton", device="cpu", max_num_batched_tokens=16,
                           **kwargs)
    assert got == hf_greedy(path, prompts)


def phi3_config(**overrides) -> transformers.Phi3Config:
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                 num_hidden_layers=1, vocab_size=64, architectures=["Phi3ForCausalLM"])
    return transformers.Phi3Config(**{**shape, **overrides})


LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}


@pytest.mark.parametrize("rope, partial, max_positions", [
    (LONGROPE, 1.0, 4096),  # long factors: the engine may hold sequences past 1024
    (LONGROPE, 1.0, 1024),  # short factors: it never does
    ({**LONGROPE, "short_factor": LONGROPE["short_factor"][:4], "long_factor": LONGROPE["long_factor"][:4]}, 0.5, 4096),
    (None, 0.75, 4096),  # Phi-4-mini's partial rotary, no scaling
], ids=["longrope-long", "longrope-short", "longrope-partial", "partial"])
def test_phi3_rope_tables_match_transformers(rope, partial, max_positions):
    config = phi3_config(max_position_embeddings=4096, original_max_position_embeddings=1024, rope_scaling=rope,
                         partial_rotary_factor=partial, rope_theta=10000.0)
    ours = RotaryEmbedding(ModelConfig.from_dict(config.to_dict()), max_positions)
    # transformers takes the long factors for a forward whose positions pass 1024, the short ones otherwise
    positions = torch.tensor([0, 1, 7, 300, 1023, 1024, 2047, 4095] if max_positions > 1024 else [0, 5, 300, 1023])
    cos, sin = ours.lookup(positions, torch.float32)
    want_cos, want_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    assert cos.shape[-1] == want_cos.shape[-1] == int(16 * partial)
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the C++ kernel (where built), PyTorch
def test_partial_rotation_is_bit_for_bit_transformers(dtype):
    rotary = RotaryEmbedding(ModelConfig.from_dict(phi3_config(partial_rotary_factor=0.5).to_dict()), 64)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 64, (9,), generator=gen)
    qk = (torch.randn(9, 6, 16, generator=gen) * 4).to(dtype)
    cos, sin = rotary.lookup(positions, dtype)
    heads = qk.transpose(0, 1)[None]
    want, _ = apply_rotary_pos_emb(heads, heads, cos[:, 0][None], sin[:, 0][None])
    got = rotary(positions, dtype).apply(qk.clone())
    assert torch.equal(got, want[0].transpose(0, 1))
    assert not torch.equal(got[..., :8], qk[..., :8]) and torch.equal(got[..., 8:], qk[..., 8:])


def test_phi3_su_rope_and_top_level_original_length_read_as_transformers_does():
    raw = phi3_config().to_dict()
    del raw["rope_parameters"]
    raw.update(rope_scaling={**LONGROPE, "type": "su", "original_max_position_embeddings": 16}, rope_theta=500.0,
               original_max_position_embeddings=1024, max_position_embeddings=4096)
    c = ModelConfig.from_dict(raw)
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_theta == 500.0
    assert c.rope_scaling["original_max_position_embeddings"] == 1024  # the top-level field wins, as in transformers
    want = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"}).rope_parameters
    assert want["rope_type"] == "longrope" and want["original_max_position_embeddings"] == 1024
    c.rope_scaling["rope_type"] = "dynamic"
    with pytest.raises(ModelError, match="unsupported rope_scaling type 'dynamic'"):
        RotaryEmbedding(c, 64)


@pytest.mark.parametrize("overrides", [
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
    dict(use_sliding_window=False, sliding_window=8, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention", "full_attention"]),
])
def test_qwen3_windows_are_transformers(overrides):
    config = transformers.Qwen3Config(hidden_size=32, num_attention_heads=2, num_hidden_layers=4, head_dim=8,
                                      architectures=["Qwen3ForCausalLM"], **overrides)
    c = ModelConfig.from_dict(config.to_dict())
    want = [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]
    assert [c.window(i) for i in range(4)] == want
    assert c.head_dim == 8 and not c.attention_bias and not c.o_proj_bias
