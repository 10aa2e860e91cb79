"""Small model layers: RMSNorm, rotary embeddings (default, linear, Llama 3, LongRoPE; whole or partial heads),
SiLU-gated MLP activation.

On the CPU (float32, bfloat16, float16) they run as C++ kernels (kernels/cpu_layers.py), one pass each, rounding as
the PyTorch forms here do; those serve every other device and dtype, and are the kernels' references."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import cpu_layers
from sluice.worker.engine.config import ModelConfig, ModelError


class RMSNorm(nn.Module):
    rounds_before_gain = True  # the normalised row is cast to x's dtype before the weight multiplies it, as the kernel

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): a decoder layer adds each sublayer's output
        to the residual stream and normalises the sum (the C++ kernel writes the sum into `residual` in place)."""
        if cpu_layers.takes(x.device, x.dtype) and (self.rounds_before_gain or x.dtype == torch.float32):
            out = cpu_layers.rms_norm(x, self.gain(), self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def gain(self) -> torch.Tensor:
        """What the normalised rows are multiplied by: the weight (Gemma's norm: 1 + weight)."""
        return self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 then back, the order transformers uses, so greedy tokens match it exactly
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if cpu_layers.takes(x.device, x.dtype):
        return cpu_layers.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [tokens, intermediate] buffer fewer, same values


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation: gelu(gate, tanh approximation) * up (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def rotary_dim(config: ModelConfig) -> int:
    """How many leading dims of each head rope turns (transformers' int(head_dim * partial_rotary_factor))."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_inv_freq(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos and sin are scaled by (1 but for LongRoPE)."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / _rope_field(scaling, "factor"), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "longrope":
        return _longrope_inv_freq(config, exponents, max_positions)
    raise ModelError(f"config.json: unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, "
                     f"longrope)")


def _rope_field(scaling: dict, name: str) -> float:
    if name not in scaling:  # a bare KeyError named nothing about where it came from
        raise ModelError(f"config.json: rope_scaling of type {scaling['rope_type']!r} needs {name!r}")
    return scaling[name]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = (_rope_field(s, name) for name in ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = _rope_field(s, "original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_inv_freq(config: ModelConfig, exponents: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE, as transformers computes it: per-dim factors stretch the wavelengths (short_factor for
    sequences within original_max_position_embeddings, long_factor past it) and cos and sin scale by an attention
    factor. transformers picks the set per forward by the sequence's length, recomputing a sequence's cache when it
    crosses; one KV cache holds one set here, so the engine picks by its max_model_len (max_positions), as vLLM does:
    long_factor when sequences may outgrow the pretraining length, short_factor otherwise."""
    s = config.rope_scaling
    old_len = _rope_field(s, "original_max_position_embeddings")
    ext = torch.tensor(_rope_field(s, "long_factor" if max_positions > old_len else "short_factor"),
                       dtype=torch.float32)
    if ext.shape != exponents.shape:
        raise ModelError(f"config.json: longrope factors need {exponents.numel()} values (half the rotary dims), got "
                         f"{ext.numel()}")
    factor = s.get("factor") or config.max_position_embeddings / old_len
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return 1.0 / (ext * config.rope_theta ** exponents), attention


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a precomputed float32 cos/sin table indexed by position, [max_positions,
    rotary_dim]: narrower than a head under a partial_rotary_factor."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, scale = rope_inv_freq(config, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # both halves equal: apply_rotary relies on it
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotation, for every layer: cos and sin looked up once per forward, [tokens, 1, head_dim]
        (the C++ kernel looks them up itself)."""
        if cpu_layers.takes(positions.device, dtype):
            return Rope(positions=positions, cos=self.cos, sin=self.sin)
        return Rope(*self.lookup(positions, dtype))

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


@dataclass
class Rope:
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None  # set: cos and sin are the whole tables, for the C++ kernel

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated: in place by the C++ kernel, into a new tensor otherwise. Under a
        partial_rotary_factor the tables are narrower than a head, whose other dims pass through (a new tensor)."""
        rotated = self.cos.shape[-1]
        if rotated < x.shape[-1]:
            return torch.cat((self.apply(x[..., :rotated]), x[..., rotated:]), dim=-1)
        if self.positions is not None:
            return cpu_layers.rotary_(x, self.positions, self.cos, self.sin)
        return apply_rotary(x, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated into a new tensor, bit for bit transformers' x*cos + rotate_half(x)*sin
    with rotate_half(x) = cat(-x2, x1), in four ops instead of five and no concatenated copy: the table's halves are
    equal, so the first half is x1*cos - x2*sin and the second x2*cos + x1*sin, and x*sin holds both products (a
    negated product rounds as the product of the negation does). q and k go through in one call."""
    out = x * cos
    x_sin = x * sin
    half = x.shape[-1] // 2
    out[..., :half] -= x_sin[..., half:]
    out[..., half:] += x_sin[..., :half]
    return out
