"""Gemma 2 and Gemma 3 (text): greedy tokens equal transformers' eager generate under every scheduling regime and on
both attention backends; logits equal its soft-capped ones; config.json read with transformers' Gemma defaults."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_greedy import hf_greedy, make_prompts, run_engine

from sluice.worker.engine import LLM
from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.models.gemma import gemma3_rope_configs

NUM_PROMPTS = 16


@pytest.fixture(scope="module")
def gemma_dirs(checkpoints, tmp_path_factory):
    """name -> the ARCHS checkpoint with random norm weights: transformers initialises Gemma's (1 + w) norms to
    w = 0, which would leave every norm weight's loading and placement untested."""
    built = {}

    def get(name: str):
        if name not in built:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints(name)), dtype=torch.float32)
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if "norm" in param_name:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            path = tmp_path_factory.mktemp(f"{name}_norms")
            model.save_pretrained(str(path))
            transformers.AutoTokenizer.from_pretrained(str(checkpoints(name))).save_pretrained(str(path))
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_case(request, gemma_dirs):
    path = gemma_dirs(request.param)
    config = transformers.AutoConfig.from_pretrained(str(path))
    prompts = make_prompts(config.vocab_size, seed=11)[:NUM_PROMPTS]
    assert max(len(ids) for ids, _ in prompts) > 3 * config.sliding_window  # prompts cross the window
    return path, prompts, hf_greedy(path, prompts, attn_implementation="eager")


def test_ample_cache(gemma_case):
    path, prompts, expected = gemma_case
    got, stats, planned = run_engine(path, prompts)
    assert got == expected
    assert stats["num_preemptions"] == 0
    assert max(len(step) for step in planned) > 1, "requests were not batched"


def test_preemption_keeps_outputs(gemma_case):
    path, prompts, expected = gemma_case
    got, stats, _ = run_engine(path, prompts, num_kv_blocks=10)
    assert stats["num_preemptions"] > 0
    assert got == expected


def test_chunked_prefill(gemma_case):
    """Chunks of at most 16 tokens: a chunk's queries start past the window of 8, over keys cached before it."""
    path, prompts, expected = gemma_case
    got, _, planned = run_engine(path, prompts, max_num_batched_tokens=16)
    assert got == expected
    chunks: dict[str, int] = {}
    for step in planned:
        for rid, n in step:
            chunks[rid] = chunks.get(rid, 0) + (n > 1)
    assert max(chunks.values()) > 1, "no prompt was prefilled over several steps"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_shared_prefix_hits_cache(gemma_dirs, arch):
    path = gemma_dirs(arch)
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(str(path)).vocab_size, seed=7,
                           shared_prefix=40)[:12]
    got, stats, _ = run_engine(path, prompts, max_num_seqs=4)
    assert stats["prefix_cache_hits"] >= (12 - 4) * 32
    assert got == hf_greedy(path, prompts, attn_implementation="eager")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_backend(gemma_dirs, arch, monkeypatch):
    """The Triton kernels' windows and soft-cap (under TRITON_INTERPRET=1 without a GPU): whole prompts, and chunks
    of 16 tokens whose queries start past the window; few tokens, as the interpreter is slow."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = gemma_dirs(arch)
    prompts = [(ids, 6) for ids, _ in make_prompts(transformers.AutoConfig.from_pretrained(str(path)).vocab_size,
                                                   seed=11)[:4]]
    assert min(len(ids) for ids, _ in prompts) < 16 < max(len(ids) for ids, _ in prompts)
    got, _, _ = run_engine(path, prompts, attention_backend="triton", max_num_batched_tokens=16)
    assert got == hf_greedy(path, prompts, attn_implementation="eager")


def test_logits_are_soft_capped_as_transformers_caps_them(gemma_dirs):
    """Greedy tokens cannot see the final soft-cap (tanh is monotonic): the logits themselves can."""
    path = gemma_dirs("gemma2")
    prompt = list(range(5, 45))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
        model.config.final_logit_softcapping = None
        uncapped = model(torch.tensor([prompt])).logits[0]
    assert (want - uncapped).abs().max() > 0.1  # the cap of 3 bites on these logits
    got = LLM(str(path)).prompt_logits(prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_config_reads_windows_and_defaults_as_transformers_does():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=2)
    for arch, cls, extra in (("Gemma2ForCausalLM", transformers.Gemma2Config, {}),
                             ("Gemma3ForCausalLM", transformers.Gemma3TextConfig, {"sliding_window_pattern": 3})):
        hf = cls(**base, **extra)
        c = ModelConfig.from_dict({"architectures": [arch], **base, **extra})  # no layer_types, head_dim, window
        assert c.layer_windows == [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
        assert (c.head_dim, c.tie_word_embeddings, c.raw["query_pre_attn_scalar"]) == (
            hf.head_dim, hf.tie_word_embeddings, hf.query_pre_attn_scalar)
        assert c.raw.get("attn_logit_softcapping") == hf.attn_logit_softcapping
        assert c.raw.get("final_logit_softcapping") == hf.final_logit_softcapping


def test_gemma3_rope_from_older_configs():
    """rope_theta + rope_scaling (global layers) and rope_local_base_freq (sliding layers), the Hub's Gemma 3 form,
    read as transformers' rope_parameters by layer type."""
    base = dict(architectures=["Gemma3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2)
    old = dict(base, rope_theta=500000.0, rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear",
                                                                                       "factor": 8.0})
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"}).rope_parameters
    full, local = gemma3_rope_configs(ModelConfig.from_dict(old))
    assert (full.rope_theta, full.rope_scaling["factor"], local.rope_theta, local.rope_scaling) == (
        hf["full_attention"]["rope_theta"], hf["full_attention"]["factor"], hf["sliding_attention"]["rope_theta"],
        None)
    full, local = gemma3_rope_configs(ModelConfig.from_dict(base))  # transformers' defaults: 1e6 and 1e4
    assert (full.rope_theta, full.rope_scaling, local.rope_theta) == (1e6, None, 1e4)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_refuses_what_it_would_compute_wrongly(change, message):
    raw = dict(architectures=["Gemma2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, **change)
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(raw)


def test_gelu_is_for_gemma_only():
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ModelError, match="unsupported hidden_act 'gelu_pytorch_tanh'"):
        ModelConfig.from_dict(raw)
