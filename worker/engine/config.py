"""Engine and model configuration: what the user chose and what config.json says."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' defaults for what a Gemma config.json may leave out, where they differ from the engine's (a 256
# head_dim, tied embeddings, windows, Gemma 2's soft caps); models/gemma.py reads the Gemma-only ones from `raw`
_GEMMA_COMMON = dict(head_dim=256, tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256,
                     hidden_activation="gelu_pytorch_tanh")
GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(_GEMMA_COMMON, max_position_embeddings=8192, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0),
    "Gemma3ForCausalLM": dict(_GEMMA_COMMON, max_position_embeddings=131072),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30
CUDA_MEMORY_FRACTION = 0.9
BACKENDS = ("auto", "torch", "triton")
CPU_GEMMS = ("auto", "sluice", "mkl", "onednn")


class ModelError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    sliding_window: int | None  # the window of the layers that slide; None when none does
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    layer_windows: list[int | None] | None = None  # per layer; None: every layer takes sliding_window
    partial_rotary_factor: float = 1.0  # Phi3: rope turns the first int(head_dim * factor) dims of each head
    # config.json as read: a model class takes the fields only its architecture has (q/k norms, experts, soft caps)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ModelError(f"{file}: not found (is {path} a Hugging Face checkpoint directory?)") from None
        except (OSError, ValueError) as e:
            raise ModelError(f"{file}: unreadable: {e}") from None
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        raw = {**GEMMA_DEFAULTS.get(arch, {}), **raw}
        try:
            num_heads = raw["num_attention_heads"]
            hidden = raw["hidden_size"]
            rope = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or rope
            rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
            if arch == "Phi3ForCausalLM":
                rope_type, scaling = _phi3_rope(raw, rope_type, scaling)
            _check_supported(raw, source, arch)
            windows = layer_windows(raw, arch)
            window = next((w for w in windows if w), None) if windows is not None else _mistral_window(raw, arch)
            llama_bias = arch == "LlamaForCausalLM" and raw.get("attention_bias", False)  # HF Mistral has none
            qwen3_bias = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and raw.get("attention_bias", False)
            gemma_bias = arch in GEMMA_DEFAULTS and raw.get("attention_bias", False)  # q/k/v and o_proj
            eos = raw.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=hidden,
                intermediate_size=raw["intermediate_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=raw.get("head_dim") or hidden // num_heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=None if rope_type == "default" else {**scaling, "rope_type": rope_type},
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                attention_bias=arch == "Qwen2ForCausalLM" or llama_bias or qwen3_bias or gemma_bias,
                # transformers' Llama, Qwen3 and Gemma bias o_proj too; Qwen2 only q/k/v
                o_proj_bias=llama_bias or qwen3_bias or gemma_bias,
                mlp_bias=arch == "LlamaForCausalLM" and raw.get("mlp_bias", False),
                sliding_window=window,
                layer_windows=windows,
                partial_rotary_factor=scaling.get("partial_rotary_factor", 1.0) if arch == "Phi3ForCausalLM" else 1.0,
                dtype=DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "float32"), torch.float32),
                eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                raw=raw,
            )
        except KeyError as e:
            raise ModelError(f"{source}: missing field {e.args[0]!r}") from None


def _mistral_window(raw: dict, arch: str) -> int | None:
    """Mistral's window, and Phi3's (every layer slides). A Llama config may carry one too (llamafied Mistral or Qwen2
    checkpoints), but transformers' Llama attends in full whatever it says, as vLLM's does: sliding there computed
    another model."""
    if arch == "Qwen3MoeForCausalLM":  # every layer slides when use_sliding_window
        return raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    slides = arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM")
    return raw.get("sliding_window") if slides else None


def _phi3_rope(raw: dict, rope_type: str, scaling: dict) -> tuple[str, dict]:
    """Phi3's rope as transformers' Phi3Config reads it: "su" and "yarn" are longrope, longrope's pretraining length is
    the top-level original_max_position_embeddings (4096 without one), partial_rotary_factor may sit at either level."""
    scaling = {**scaling, "partial_rotary_factor": scaling.get("partial_rotary_factor",
                                                               raw.get("partial_rotary_factor", 1.0))}
    if rope_type in ("su", "yarn", "longrope"):
        rope_type = "longrope"
        scaling["original_max_position_embeddings"] = raw.get("original_max_position_embeddings", 4096)
    return rope_type, scaling


def _check_supported(raw: dict, source: str, arch: str) -> None:
    """Refuse what the engine would otherwise load and compute wrongly without a word."""
    from sluice.worker.engine.prequantized import checkpoint_quantization  # it imports ModelError from here

    checkpoint_quantization(raw, source)  # refuses the methods and formats it cannot repack, naming them
    if arch in GEMMA_DEFAULTS:
        _check_gemma(raw, source)
        return
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"{source}: unsupported hidden_act {act!r}; the engine's MLP is SiLU-gated (silu/swish)")


def _check_gemma(raw: dict, source: str) -> None:
    """Gemma's MLP is GELU-gated, named by hidden_activation (transformers ignores a hidden_act there)."""
    act = raw["hidden_activation"]
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"{source}: unsupported hidden_activation {act!r}; Gemma's MLP is gelu_pytorch_tanh-gated")
    if raw.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention is not supported (the engine attends causally)")


def layer_windows(raw: dict, arch: str) -> list[int | None] | None:
    """Qwen2's and Qwen3's per-layer windows, as transformers reads them: `layer_types` if given, else the layers from
    max_window_layers on slide (when use_sliding_window). None for Llama and Mistral: one window (or none) for all."""
    if arch in GEMMA_DEFAULTS:
        return _gemma_windows(raw, arch)
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types") or ["sliding_attention" if window is not None and i >= raw.get(
        "max_window_layers", 28) else "full_attention" for i in range(n)]
    return [window if t == "sliding_attention" else None for t in types]


def _gemma_windows(raw: dict, arch: str) -> list[int | None]:
    """Gemma's, as transformers reads them: `layer_types` if given, else every `pattern`-th layer attends in full and
    the others slide (Gemma 2: every other layer; Gemma 3: sliding_window_pattern, 6 unless given)."""
    pattern = 2 if arch == "Gemma2ForCausalLM" else raw.get("sliding_window_pattern", 6)
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(raw["num_hidden_layers"])]
    return [raw["sliding_window"] if t == "sliding_attention" else None for t in types]


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "decode_first"
    quantization: str | None = None
    quantization_group_size: int = 128
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # CPU projections: "sluice" (its own GEMM, bfloat16 on AVX512-BF16 and float32 on AVX-512), "mkl" or "onednn"
    # (float32; bfloat16 takes oneDNN's), or "auto": sluice's for bfloat16 (oneDNN's where the CPU has AMX tiles),
    # MKL's float32 on Intel, oneDNN's elsewhere
    cpu_gemm: str = "auto"
    load_format: str = "auto"
    enable_lora: bool = False  # LoRA adapters, named per request (lora.LoRARequest), served beside the base model
    max_loras: int = 8  # adapters on the device at once: the most distinct adapters one step can run
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling_policy not in ("decode_first", "prefill_first"):
            raise ValueError("scheduling_policy must be 'decode_first' or 'prefill_first'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' (the model dtype) or 'int8', got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' (safetensors) or 'dummy' (random, for benchmarks), "
                             f"got {self.load_format!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMMS)}, got {self.cpu_gemm!r}")
        for name in ("attention_backend", "linear_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {', '.join(BACKENDS)}, got {getattr(self, name)!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def backend(self, name: str) -> str:
        """'triton' on CUDA and 'torch' elsewhere, unless the user forced one."""
        chosen = getattr(self, name)
        on_cuda = self.torch_device().type == "cuda"
        if chosen == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{name}='triton' needs a CUDA device (or TRITON_INTERPRET=1, Triton's CPU interpreter)")
        if chosen != "auto":
            return chosen
        return "triton" if on_cuda else "torch"

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        return model.dtype if self.dtype == "auto" else DTYPES[self.dtype]
