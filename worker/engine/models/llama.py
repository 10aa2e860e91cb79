"""Llama-family decoder (Llama, Mistral, Qwen2): one forward over all of a step's tokens, packed."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from sluice.worker.engine.attention import AttentionBackend, AttentionMetadata, LayerCache
from sluice.worker.engine.config import ModelConfig
from sluice.worker.engine.layers import RMSNorm, Rope, RotaryEmbedding, silu_and_mul
from sluice.worker.engine.linear import Linear

# checkpoint projection name -> (fused module, shard index)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# a CPU prefill's MLP runs this many tokens at a time: the [tokens, 2 x intermediate] activation then stays in cache
# between gate/up, SiLU and down (bench/NOTES.md has the measurement)
CPU_MLP_ROWS = 512


class Attention(nn.Module):
    softcap: float | None = None  # Gemma 2 soft-caps the scores

    def __init__(self, c: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, [q_size, kv_size, kv_size], bias=c.attention_bias)
        self.o_proj = Linear(q_size, [c.hidden_size], bias=c.o_proj_bias)
        self.backend = backend
        self.scale = c.head_dim ** -0.5

    def forward(self, x, rope: Rope, cache: LayerCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Stores every token's K and V; returns the output of every token, or of the `keep` rows only."""
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        heads = self.num_heads + self.num_kv_heads
        qk = rope.apply(self.norm_qk(qkv[:, :heads]))  # q's and k's heads are adjacent: rotated in one pass
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, heads:]
        self.backend.store(k, v, cache, meta)
        out = self.backend.attend(q, cache, meta, self.scale, self.softcap).reshape(-1, self.num_heads * self.head_dim)
        return self.o_proj(out if keep is None else out[keep])

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q's heads then k's [tokens, heads + kv_heads, head_dim], before rope: Llama leaves them, Qwen3 norms them."""
        return qk


class MLP(nn.Module):
    act = staticmethod(silu_and_mul)  # gate and up side by side -> act(gate) * up (Gemma: GELU-tanh)

    def __init__(self, c: ModelConfig, bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, [c.intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(c.intermediate_size, [c.hidden_size], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LoRA finds a projection's rows by their count (lora_layers.LoRAMapping): chunks would hide which they are
        if x.device.type != "cpu" or x.shape[0] <= CPU_MLP_ROWS or self.down_proj.lora is not None:
            return self.down_proj(self.gated(x))
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], CPU_MLP_ROWS):
            rows = slice(start, start + CPU_MLP_ROWS)
            out[rows] = self.down_proj(self.gated(x[rows]))
        return out

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: from the GEMM itself where its method fuses SiLU (and no adapter changes gate_up's
        output first), else the projection, then act."""
        proj = self.gate_up_proj
        fuse = getattr(proj.method, "fused_silu_and_mul", None)
        if fuse is not None and self.act is silu_and_mul and proj.lora is None:
            out = fuse(proj, x)
            if out is not None:
                return out
        return self.act(proj(x))


class DecoderLayer(nn.Module):
    attention_cls = Attention
    norm_cls = RMSNorm

    def __init__(self, c: ModelConfig, backend: AttentionBackend, index: int = 0):
        super().__init__()
        self.input_layernorm = self.norm_cls(c.hidden_size, c.rms_norm_eps)
        self.self_attn = self.attention_cls(c, backend)
        self.post_attention_layernorm = self.norm_cls(c.hidden_size, c.rms_norm_eps)
        self.mlp = self.make_mlp(c, index)

    def make_mlp(self, c: ModelConfig, index: int) -> nn.Module:
        """Layer `index`'s feed-forward block: a subclass returns another (mixture-of-experts models, models/moe.py)."""
        return MLP(c, c.mlp_bias)

    def forward(self, x, residual, rope: Rope, cache: LayerCache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, to add to `residual` (None before the first layer: x is the embeddings).
        Returns this layer's MLP output and the residual stream before it, of the `keep` rows only if given."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, cache, meta, keep)
        h, residual = self.post_attention_layernorm(h, residual if keep is None else residual[keep])
        return self.mlp(h), residual


class Decoder(nn.Module):
    layer_cls = DecoderLayer
    norm_cls = RMSNorm
    embedding_cls = nn.Embedding
    rotary_cls = RotaryEmbedding  # its output goes to every layer, which takes its rope from it

    def __init__(self, c: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.rotary = self.rotary_cls(c, max_positions)
        # a weight given, so none is drawn: random init on the meta device would import torch._dynamo (and Triton)
        self.embed_tokens = self.embedding_cls(c.vocab_size, c.hidden_size,
                                               _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(self.layer_cls(c, backend, i) for i in range(c.num_layers))
        self.norm = self.norm_cls(c.hidden_size, c.rms_norm_eps)
        self.windows = [c.window(i) for i in range(c.num_layers)]

    def forward(self, input_ids, positions, caches: list[LayerCache], meta: AttentionMetadata,
                keep: torch.Tensor | None = None):
        """Hidden states of every token, or of the `keep` rows only: a prompt token's last-layer output is never
        read (only its K and V are), so the last layer's o_proj and MLP run on the rows that are sampled."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions, x.dtype)
        last = len(self.layers) - 1
        # each layer attends within its own window (Qwen2 slides only some layers): one metadata per window
        metas = {w: meta if w == meta.sliding_window else replace(meta, sliding_window=w) for w in set(self.windows)}
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, residual = layer(x, residual, rope, cache, metas[self.windows[i]], keep if i == last else None)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM: the config says what differs."""

    decoder_cls = Decoder
    split_fused = True  # the checkpoint stores q/k/v and gate/up as separate tensors (Phi3 stores them fused)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.decoder_cls(config, backend, max_positions)
        self.lm_head = Linear(config.hidden_size, [config.vocab_size])
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, caches: list[LayerCache], meta: AttentionMetadata,
                keep: torch.Tensor | None = None):
        return self.model(input_ids, positions, caches, meta, keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_tensors(self) -> dict[str, tuple[torch.Tensor, slice | None]]:
        """Every tensor the checkpoint must hold: name -> (destination parameter, rows in it)."""
        names: dict[str, tuple[torch.Tensor, slice | None]] = {}
        for name, module in self.named_modules():
            params = {"weight": getattr(module, "weight", None), "bias": getattr(module, "bias", None)}
            for kind, param in params.items():
                if not isinstance(param, torch.Tensor) or (module is self.lm_head and self.config.tie_word_embeddings):
                    continue
                if isinstance(module, Linear) and len(module.out_sizes) > 1 and self.split_fused:
                    prefix, fused = name.rsplit(".", 1)
                    for proj, (target, shard) in FUSED.items():
                        if target == fused:
                            names[f"{prefix}.{proj}.{kind}"] = (param, module.shard_rows(shard))
                else:
                    names[f"{name}.{kind}"] = (param, None)
        return names
