"""Qwen3: Llama's decoder with every q and k head RMS-normalised before rope (transformers' Qwen3Attention)."""

from __future__ import annotations

import torch

from sluice.worker.engine.attention import AttentionBackend
from sluice.worker.engine.config import ModelConfig
from sluice.worker.engine.layers import RMSNorm
from sluice.worker.engine.models.llama import Attention, Decoder, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    """Llama's attention plus q_norm and k_norm over head_dim (each head one row); Qwen3-MoE's attention too."""

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__(c, backend)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        return torch.cat((q, k), dim=1)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Decoder(Decoder):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_cls = Qwen3Decoder
