"""Phi3 (Phi-3, Phi-3.5, Phi-4-mini): Llama's decoder; config.py and layers.py read its rope (LongRoPE, partial
rotary) and sliding window."""

from __future__ import annotations

from sluice.worker.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    split_fused = False  # the checkpoint holds qkv_proj and gate_up_proj, q/k/v and gate/up in the engine's order
