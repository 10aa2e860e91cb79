"""The engine's rotary embedding against transformers' own: the same cos/sin tables (default, linear and Llama 3
scaling), and a rotation equal bit for bit to apply_rotary_pos_emb, for q and k rotated together."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.layers import RotaryEmbedding, apply_rotary

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


def hf_config(scaling) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=4096, rope_theta=50000.0, rope_scaling=scaling,
                       architectures=["LlamaForCausalLM"])


@pytest.mark.parametrize("scaling", SCALINGS)
def test_tables_match_transformers(scaling):
    config = hf_config(SCALINGS[scaling])
    ours = RotaryEmbedding(ModelConfig.from_dict(config.to_dict()), 4096)
    positions = torch.tensor([0, 1, 7, 300, 2047, 4095])
    cos, sin = ours.lookup(positions, torch.float32)
    x = torch.zeros(1, len(positions), HEAD_DIM)
    want_cos, want_sin = LlamaRotaryEmbedding(config)(x, positions[None])
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotation_is_bit_for_bit_transformers(dtype):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(ModelConfig.from_dict(hf_config(None).to_dict()), 4096)
    positions = torch.randint(0, 4096, (37,))
    cos, sin = rotary.lookup(positions, dtype)
    # q's and k's heads side by side in a wider row, as the fused qkv projection leaves them (a strided view)
    qkv = (torch.randn(len(positions), HEADS + 2 * KV_HEADS, HEAD_DIM) * 4).to(dtype)
    out = apply_rotary(qkv[:, :HEADS + KV_HEADS], cos, sin)
    q, k = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS]
    # transformers: [batch, heads, tokens, head_dim], cos and sin [batch, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None],
                                          sin[:, 0][None])
    assert torch.equal(out[:, :HEADS], want_q[0].transpose(0, 1))
    assert torch.equal(out[:, HEADS:], want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, :HEADS], q)  # the input is left as it was
    # the step's Rope as the model applies it: the C++ kernel in place for float32 on the CPU (where built)
    rotated = qkv.clone()
    assert torch.equal(rotary(positions, dtype).apply(rotated[:, :HEADS + KV_HEADS]), out)
    assert torch.equal(rotated[:, HEADS + KV_HEADS:], qkv[:, HEADS + KV_HEADS:])  # v is never touched


@pytest.mark.parametrize("scaling, missing", [("linear", "factor"), ("llama3", "low_freq_factor"),
                                              ("llama3", "original_max_position_embeddings")])
def test_a_rope_scaling_without_a_field_its_type_needs_is_named(scaling, missing):
    config = ModelConfig.from_dict(hf_config(SCALINGS[scaling]).to_dict())
    config.rope_scaling = {k: v for k, v in config.rope_scaling.items() if k != missing}
    with pytest.raises(ModelError, match=f"rope_scaling of type '{scaling}' needs '{missing}'"):
        RotaryEmbedding(config, 64)
