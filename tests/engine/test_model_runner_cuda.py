"""The model runner's CUDA-only decisions, checked without a GPU: the device it makes current and the KV cache it
sizes from free memory (torch.cuda's calls stand in)."""

from __future__ import annotations

import pytest
import torch

from sluice.worker.engine import model_runner
from sluice.worker.engine.config import EngineConfig, ModelConfig
from sluice.worker.engine.model_runner import ModelRunner

LLAMA3_8B = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"})
GiB = 1 << 30


class Built(Exception):
    """Raised in place of building the model: the runner got that far."""


@pytest.mark.parametrize("device, current", [("cuda:1", [torch.device("cuda:1")]), ("cuda", [])])
def test_the_engine_device_is_made_current_before_anything_runs_there(monkeypatch, device, current):
    """Triton launches on the current device whatever its tensors' device; 'cuda' (no index) is the current one."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)

    def build(*args):
        assert calls == current
        raise Built

    monkeypatch.setattr(model_runner, "build_model", build)
    config = EngineConfig(model="unused", device=device, attention_backend="torch", linear_backend="torch")
    with pytest.raises(Built):
        ModelRunner(config, LLAMA3_8B, "unused", 8192)


@pytest.mark.parametrize("kv_cache_dtype, expected", [("auto", 35760), ("int8", 69353)])
def test_kv_cache_takes_90_percent_of_free_memory_after_activations(monkeypatch, kv_cache_dtype, expected):
    """By hand for Llama-3-8B in bfloat16, 16-token blocks and the default 4096-token step budget: activations
    4096 x (2 x 14336 + 128256) x 4 = 2,571,108,352 bytes; 80 GiB free once PyTorch's cache is emptied (70 GiB
    before: 10 GiB of it held the float weights that quantization freed); int((80 GiB - activations) x 0.9) =
    74,995,413,811 bytes. A block holds K and V of 32 layers x 16 tokens x 8 KV heads: x 128 x 2 bytes = 2 MiB in
    bfloat16 -> 35,760 blocks; x (128 + 4) bytes = 1,081,344 in int8 with a float32 scale per token and head ->
    69,353 blocks."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: ((80 if emptied else 70) * GiB, 80 * GiB))
    runner = ModelRunner.__new__(ModelRunner)  # the sizing alone: no model on a device that is not there
    runner.config = EngineConfig(model="unused", device="cuda", kv_cache_dtype=kv_cache_dtype)
    runner.model_config, runner.device, runner.dtype = LLAMA3_8B, torch.device("cuda"), torch.bfloat16
    runner.block_size, runner.max_model_len, runner.kv_int8 = 16, 8192, kv_cache_dtype == "int8"
    assert runner._num_kv_blocks() == expected
