"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE, Llama's (Qwen3's) decoder with a sparse feed-forward block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.fused_moe import FusedExperts, route
from sluice.worker.engine.linear import Linear
from sluice.worker.engine.models.llama import MLP, Decoder, DecoderLayer, LlamaForCausalLM
from sluice.worker.engine.models.qwen3 import Qwen3Attention


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights rescaled to sum to 1
    sparse_layers: frozenset[int]  # the others have a dense MLP of the model's intermediate_size

    @classmethod
    def of(cls, c: ModelConfig) -> MoeConfig:
        raw, n = c.raw, c.num_layers
        # either name, as transformers' configs map one onto the other (its save_pretrained writes num_local_experts)
        experts = raw["num_local_experts"] if "num_local_experts" in raw else raw.get("num_experts")
        if experts is None:
            raise ModelError(f"config.json: {c.architecture} needs 'num_experts' (or 'num_local_experts')")
        try:
            if c.architecture == "MixtralForCausalLM":
                m = cls(experts, raw["num_experts_per_tok"], c.intermediate_size, True, frozenset(range(n)))
            else:  # Qwen3-MoE: the defaults transformers' Qwen3MoeConfig gives absent fields
                step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
                if step < 1:
                    raise ModelError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
                sparse = {i for i in range(n) if i not in dense and (i + 1) % step == 0}
                m = cls(experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                        raw.get("norm_topk_prob", False), frozenset(sparse if experts > 0 else ()))
        except KeyError as e:
            raise ModelError(f"config.json: {c.architecture} needs {e.args[0]!r}") from None
        if m.sparse_layers and not 1 <= m.top_k <= m.num_experts:
            raise ModelError(f"config.json: num_experts_per_tok {m.top_k} must be from 1 to the {m.num_experts} "
                             f"experts")
        return m


class SparseMoeBlock(nn.Module):
    """The router (`gate`, kept in float: quantization leaves it) and the experts it picks top_k of per token."""

    def __init__(self, c: ModelConfig, m: MoeConfig):
        super().__init__()
        self.top_k, self.renormalize = m.top_k, m.renormalize
        self.gate = Linear(c.hidden_size, [m.num_experts])
        self.experts = FusedExperts(m.num_experts, c.hidden_size, m.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, c: ModelConfig, index: int) -> nn.Module:
        m = MoeConfig.of(c)
        return SparseMoeBlock(c, m) if index in m.sparse_layers else MLP(c, c.mlp_bias)


class MoeDecoder(Decoder):
    layer_cls = MoeDecoderLayer


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeDecoder(Decoder):
    layer_cls = Qwen3MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_cls = MoeDecoder
    block_name = "block_sparse_moe"  # the sparse block's name in checkpoints (the engine's module is `mlp`)
    expert_names = ("w1", "w3", "w2")  # gate, up, down

    def checkpoint_tensors(self) -> dict[str, tuple[torch.Tensor, slice | None]]:
        """Llama's tensors (the router is a Linear, `gate`), each expert's gate, up and down rows of the stacked
        expert weights, under the names published checkpoints and transformers' save_pretrained use."""
        names = {}
        for name, dest in super().checkpoint_tensors().items():
            names[self._renamed(name)] = dest
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                names.update(module.checkpoint_tensors(self._renamed(name), self.expert_names))
        return names

    def _renamed(self, name: str) -> str:
        for part in (".gate.", ".experts"):
            name = name.replace(f".mlp{part}", f".{self.block_name}{part}")
        return name


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    decoder_cls = Qwen3MoeDecoder
    block_name = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")
