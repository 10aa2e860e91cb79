"""Gemma 2 and Gemma 3 (text): Llama's decoder with (1 + w) norms around both sublayers, a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden_size), sliding-window layers between global ones, and Gemma 2's soft-capped
attention scores and logits or Gemma 3's q/k norms and per-layer rope bases (transformers' Gemma2/Gemma3 models)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from sluice.worker.engine.attention import AttentionBackend, AttentionMetadata, LayerCache
from sluice.worker.engine.config import ModelConfig
from sluice.worker.engine.layers import RMSNorm, Rope, RotaryEmbedding, gelu_tanh_and_mul
from sluice.worker.engine.models.llama import MLP, Attention, Decoder, DecoderLayer, LlamaForCausalLM
from sluice.worker.engine.models.qwen3 import Qwen3Attention

GEMMA3 = "Gemma3ForCausalLM"


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the product in float32, cast back after it (Llama's casts before, as the C++ kernel
    does: it takes this norm in float32 only)."""

    rounds_before_gain = False

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)  # the identity, as transformers initialises it

    def gain(self) -> torch.Tensor:
        return 1 + self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)  # 1 + w in float32 too, as transformers


class GemmaEmbedding(nn.Embedding):
    """Embeddings times sqrt(hidden_size), the factor rounded to the model dtype first as transformers does (bfloat16
    turns sqrt(3072) into 55.5)."""

    def __init__(self, num: int, dim: int, _weight: torch.Tensor | None = None):
        super().__init__(num, dim, _weight=_weight)
        # made in the default dtype, the model's (loader.build_model): straight from the double, as transformers' is
        self.register_buffer("normalizer", torch.tensor(dim ** 0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.normalizer.to(self.weight.dtype)


class GemmaMLP(MLP):
    act = staticmethod(gelu_tanh_and_mul)


class GemmaAttention(Attention):
    """Gemma 2's: scores scaled by query_pre_attn_scalar^-0.5 and soft-capped by attn_logit_softcapping."""

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__(c, backend)
        self.scale = c.raw["query_pre_attn_scalar"] ** -0.5
        self.softcap = c.raw.get("attn_logit_softcapping")


class Gemma3Attention(GemmaAttention):
    """Gemma 3's: every q and k head (1 + w)-normalised before rope, as Qwen3 normalises them, and no soft cap
    (transformers' Gemma 3 passes none, whatever its config says)."""

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__(c, backend)
        self.softcap = None
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)

    norm_qk = Qwen3Attention.norm_qk


class GemmaRotary(nn.Module):
    """The rope of the global layers and that of the sliding ones: Gemma 3 gives each its own base and scaling (its
    local base rope_local_base_freq, unscaled); Gemma 2 rotates both alike."""

    def __init__(self, c: ModelConfig, max_positions: int):
        super().__init__()
        full, local = gemma3_rope_configs(c) if c.architecture == GEMMA3 else (c, None)
        self.full = RotaryEmbedding(full, max_positions)
        self.local = None if local is None else RotaryEmbedding(local, max_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Rope, Rope]:
        """(global rope, sliding rope) of the step."""
        full = self.full(positions, dtype)
        return full, full if self.local is None else self.local(positions, dtype)


def gemma3_rope_configs(c: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    """The global and the sliding layers' rope, as Gemma3TextConfig reads them: rope_parameters by layer type, or
    the older rope_theta (1e6 unless given) with rope_scaling for the global layers and rope_local_base_freq (1e4) for
    the sliding ones."""
    params = c.raw.get("rope_parameters") or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    full.update(c.raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", c.raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", c.raw.get("rope_local_base_freq", 10_000.0))
    return _with_rope(c, full), _with_rope(c, local)


def _with_rope(c: ModelConfig, params: dict) -> ModelConfig:
    kind = params.get("rope_type", params.get("type", "default"))
    return replace(c, rope_theta=float(params["rope_theta"]),
                   rope_scaling=None if kind == "default" else {**params, "rope_type": kind})


class GemmaDecoderLayer(DecoderLayer):
    """Four norms: before and after attention, before and after the MLP; the sublayers' outputs join the residual
    stream after their post-norms."""

    attention_cls = GemmaAttention
    norm_cls = GemmaRMSNorm

    def __init__(self, c: ModelConfig, backend: AttentionBackend, index: int = 0):
        super().__init__(c, backend, index)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.sliding = c.window(index) is not None

    def make_mlp(self, c: ModelConfig, index: int) -> nn.Module:
        return GemmaMLP(c)

    def forward(self, x, residual, ropes: tuple[Rope, Rope], cache: LayerCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward; `ropes` holds the global layers' rope and the sliding layers'."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, ropes[self.sliding], cache, meta, keep))
        h, residual = self.pre_feedforward_layernorm(h, residual if keep is None else residual[keep])
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma3Attention


class GemmaDecoder(Decoder):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    embedding_cls = GemmaEmbedding
    rotary_cls = GemmaRotary


class Gemma3Decoder(GemmaDecoder):
    layer_cls = Gemma3DecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Logits soft-capped by final_logit_softcapping when set (Gemma 2's default; Gemma 3 sets none)."""

    decoder_cls = GemmaDecoder

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.final_softcap = config.raw.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:  # in the model dtype, as transformers caps them
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_cls = Gemma3Decoder
