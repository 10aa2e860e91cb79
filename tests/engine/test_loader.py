"""Checkpoint loading: sharded files, dtypes, Llama 3 rope scaling, and errors that name the file or tensor."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.config import ModelError
from sluice.worker.engine.demo import build_checkpoint
from sluice.worker.engine.sampling_params import SamplingParams as SP
from sluice.worker.engine.sequence import Sequence


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's logits for the token after `ids`, from one prefill through the paged cache."""
    seq = Sequence("probe", ids, SP(), 0.0)
    llm.block_manager.allocate(seq, len(ids))
    try:
        logits, _ = llm.runner.run([(seq, len(ids))])
    finally:
        llm.block_manager.free(seq)
    return logits[0]


def hf_last_logits(path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.01), ("float16", 0.002)])
def test_half_precision_checkpoint_loads_in_its_dtype(tmp_path, tokenizer_dir, dtype, tol):
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=2, dtype=dtype, tokenizer_dir=tokenizer_dir,
                            initializer_range=0.1)
    llm = LLM(str(path))
    assert llm.runner.dtype == getattr(torch, dtype)
    # every tensor once (projections packed for oneDNN's GEMM where the CPU has native half arithmetic included)
    stored = sum(t.numel() for f in path.glob("*.safetensors") for t in load_file(f).values())
    assert llm.stats()["weight_bytes"] == stored * 2
    ids = [random.Random(0).randrange(5, 500) for _ in range(40)]
    ours, ref = last_logits(llm, ids), hf_last_logits(path, ids, getattr(torch, dtype))
    assert (ours - ref).abs().max() <= tol * ref.abs().max()
    as_fp32 = LLM(str(path), dtype="float32")
    assert as_fp32.runner.dtype == torch.float32


def test_sharded_checkpoint(tmp_path, tokenizer_dir):
    path = build_checkpoint(tmp_path / "one", "Qwen2ForCausalLM", seed=3, tokenizer_dir=tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(sharded))
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(max_tokens=8, temperature=0)
    a = LLM(str(path)).generate("sharded weights", params)[0].token_ids
    b = LLM(str(sharded)).generate("sharded weights", params)[0].token_ids
    assert a == b


def test_llama3_rope_scaling_matches_transformers(tmp_path, tokenizer_dir):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=4, tokenizer_dir=tokenizer_dir, rope_scaling=rope)
    config = json.loads((path / "config.json").read_text())
    assert (config.get("rope_scaling") or config.get("rope_parameters"))["rope_type"] == "llama3"
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (20, 60, 120, 200)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    got = LLM(str(path)).generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == expected


def test_old_style_rope_scaling_keys_are_read(tmp_path, tokenizer_dir):
    from sluice.worker.engine.config import ModelConfig

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16"}
    c = ModelConfig.from_dict(raw)
    assert c.rope_theta == 500000.0 and c.rope_scaling["factor"] == 8.0 and c.dtype == torch.bfloat16
    assert c.num_kv_heads == 2 and c.head_dim == 4


@pytest.fixture
def ckpt(tmp_path, tokenizer_dir):
    return build_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=6, tokenizer_dir=tokenizer_dir)


def test_unknown_architecture_is_named(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(ckpt))


def test_missing_tensor_is_named(ckpt):
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(ckpt))


def test_mismatched_tensor_is_named(ckpt):
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight "
                                         r"has shape \(3, 64\)"):
        LLM(str(ckpt))


def test_unreadable_files_are_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="model.safetensors: unreadable"):
        LLM(str(ckpt))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        LLM(str(ckpt))
    (ckpt / "config.json").write_text("{broken")
    with pytest.raises(ModelError, match="config.json: unreadable"):
        LLM(str(ckpt))


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelError, match="config.json: not found"):
        LLM(str(tmp_path / "nowhere"))


def randomize_biases(path) -> None:
    """transformers initializes biases to zero: give them values, so a dropped bias changes the logits."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.5
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_llama_biases_match_transformers(tmp_path, tokenizer_dir, bias):
    """Llama's attention_bias biases o_proj as well as q/k/v; mlp_bias biases gate/up/down."""
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=7, tokenizer_dir=tokenizer_dir, initializer_range=0.1,
                            **{bias: True})
    randomize_biases(path)
    ids = [random.Random(1).randrange(5, 500) for _ in range(30)]
    ref = hf_last_logits(path, ids, torch.float32)
    ours = last_logits(LLM(str(path)), ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    quantized = last_logits(LLM(str(path), quantization="int8"), ids)  # the quantized path adds the biases too
    assert (quantized - ref).abs().max() <= 0.05 * ref.abs().max()


def test_unexpected_tensor_is_named(ckpt):
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # harmless: still ignored
    save_file(tensors, str(file), metadata={"format": "pt"})
    LLM(str(ckpt))
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.ones(64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"unexpected tensor model\.layers\.0\.mlp\.down_proj\.bias"):
        LLM(str(ckpt))


@pytest.mark.parametrize("same", [True, False], ids=["identical", "different"])
def test_tied_checkpoint_with_stored_head(tmp_path, tokenizer_dir, same):
    """A stored lm_head.weight equal to the embeddings stays tied; a different one is used, as transformers does."""
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=8, tokenizer_dir=tokenizer_dir, initializer_range=0.1,
                            tie_word_embeddings=True)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if same else torch.randn_like(embed)
    save_file(tensors, str(file), metadata={"format": "pt"})
    llm = LLM(str(path))
    model = llm.runner.model
    assert (getattr(model.lm_head, "weight", None) is model.model.embed_tokens.weight) == same  # packing takes it
    ids = [random.Random(2).randrange(5, 500) for _ in range(30)]
    ref = hf_last_logits(path, ids, torch.float32)
    assert (last_logits(llm, ids) - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("field,value,error", [
    ("hidden_act", "gelu_pytorch_tanh", "unsupported hidden_act 'gelu_pytorch_tanh'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization method 'fp8' is not supported.*int8/int4"),
])
def test_unsupported_config_is_refused(ckpt, field, value, error):
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=error):
        LLM(str(ckpt))


def test_max_model_len_beyond_the_model_is_refused(tmp_path, tokenizer_dir):
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=9, tokenizer_dir=tokenizer_dir,
                            max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_model_len \(256\).*max_position_embeddings \(64\)"):
        LLM(str(path), max_model_len=256)
    assert LLM(str(path), max_model_len=32).max_model_len == 32
    assert LLM(str(path)).max_model_len == 64


def test_a_max_model_len_under_one_is_refused():
    from sluice.worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        EngineConfig(model="m", max_model_len=0)


def test_linear_rope_scaling_extends_max_model_len():
    from sluice.worker.engine.config import EngineConfig, ModelConfig
    from sluice.worker.engine.processor import max_model_len

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert max_model_len(EngineConfig(model="m", max_model_len=256), ModelConfig.from_dict(raw)) == 256
    with pytest.raises(ValueError, match="linear rope factor 4.0"):
        max_model_len(EngineConfig(model="m", max_model_len=257), ModelConfig.from_dict(raw))


def test_qwen2_layer_windows_follow_transformers():
    from sluice.worker.engine.config import ModelConfig

    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 3, "num_attention_heads": 2, "sliding_window": 8}
    assert ModelConfig.from_dict({**raw, "use_sliding_window": True, "max_window_layers": 1}).layer_windows == [
        None, 8, 8]
    off = ModelConfig.from_dict({**raw, "use_sliding_window": False})
    assert off.sliding_window is None and off.layer_windows == [None] * 3
    typed = ModelConfig.from_dict({**raw, "use_sliding_window": True, "layer_types": [
        "sliding_attention", "full_attention", "full_attention"]})
    assert typed.layer_windows == [8, None, None] and typed.sliding_window == 8
