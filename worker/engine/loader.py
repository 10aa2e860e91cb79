"""Loads a Hugging Face checkpoint directory's safetensors into an engine model, naming any bad file or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.models import MODELS

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved
TIED_HEAD = "lm_head.weight"


def build_model(config: ModelConfig, backend, max_positions: int, dtype: torch.dtype, device: torch.device):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return MODELS[config.architecture](config, backend, max_positions)
    finally:
        torch.set_default_dtype(default)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{index}: unreadable index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelError(f"{index}: lists shard(s) not in the directory: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights found")
    return files


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copy every tensor the model expects from the checkpoint; missing or misshapen ones are errors."""
    path = Path(path)
    expected = model.checkpoint_tensors()
    loaded: set[str] = set()
    head: torch.Tensor | None = None  # a tied model's stored lm_head.weight, compared once the embeddings are in
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name == TIED_HEAD and name not in expected and model.config.tie_word_embeddings:
                        head = f.get_tensor(name)
                    elif name in expected:
                        _copy(expected[name], f.get_tensor(name), name, file)
                        loaded.add(name)
                    elif not name.endswith(IGNORED_SUFFIXES):
                        # a tensor the model has no place for is a weight it would compute without
                        raise ModelError(f"{file.name}: unexpected tensor {name} (not used by "
                                         f"{model.config.architecture} with this config.json)")
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own types for corrupt headers and data
            raise ModelError(f"{file}: unreadable safetensors file: {e}") from None
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelError(f"{path}: checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")
    if head is not None:
        _untie_if_different(model, head)


def _untie_if_different(model: torch.nn.Module, head: torch.Tensor) -> None:
    """transformers uses a tied checkpoint's stored lm_head.weight when it differs from the embeddings: so do we."""
    embed = model.model.embed_tokens.weight
    if head.shape != embed.shape:
        raise ModelError(f"tensor {TIED_HEAD} has shape {tuple(head.shape)}, the config implies {tuple(embed.shape)}")
    head = head.to(embed.dtype)
    if not torch.equal(head, embed.detach().cpu()):
        model.lm_head.weight = torch.nn.Parameter(head.to(embed.device), requires_grad=False)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place of a checkpoint (vLLM's load_format="dummy"): benchmarks need only config.json."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _copy(dest: tuple[torch.Tensor, slice | None], tensor: torch.Tensor, name: str, file: Path) -> None:
    param, rows = dest
    target = param.data if rows is None else param.data[rows]
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelError(
            f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}"
        )
    target.copy_(tensor)
