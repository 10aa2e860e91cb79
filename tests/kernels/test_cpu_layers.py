"""The C++ CPU element-wise layers (kernels/cpu_layers.py) against transformers' own Llama layers and PyTorch's ops,
in float32, bfloat16 and float16 (against the float32 references too), and the engine's layers taking them on the
CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from sluice.kernels import cpu_layers
from sluice.worker.engine import layers
from sluice.worker.engine.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_layers.available(), reason="no C++ toolchain to build the kernels")


def _hf_norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.numel(), eps)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("d", [64, 100, 1024])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_transformers(rows, d):
    gen = torch.Generator().manual_seed(rows * d)
    x, weight = torch.randn(rows, d, generator=gen) * 3, torch.rand(d, generator=gen) + 0.5
    got = cpu_layers.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, _hf_norm(weight, 1e-5)(x), rtol=2e-6, atol=1e-6)


def test_rms_norm_adds_the_residual_in_place_first():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(33, 3 * 96, generator=gen)
    x = wide[:, 96:192]  # a strided view: rows 288 floats apart
    residual, weight = torch.randn(33, 96, generator=gen), torch.rand(96, generator=gen)
    want_sum = x + residual
    got = cpu_layers.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, want_sum)  # the same single rounding as PyTorch's add
    torch.testing.assert_close(got, _hf_norm(weight, 1e-6)(want_sum), rtol=2e-6, atol=1e-6)
    assert got.is_contiguous() and torch.equal(x, wide[:, 96:192])


def test_silu_and_mul_matches_pytorch_including_extremes():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(45, 2 * 200, generator=gen) * 4
    x[0, :6] = torch.tensor([-100.0, -88.5, -20.0, 0.0, 20.0, 100.0])  # exp over- and underflow for silu
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_layers.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_rotary_is_bit_for_bit_transformers_for_q_and_k_in_a_fused_qkv():
    heads, kv_heads, dim, tokens = 8, 2, 64, 37
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    rope = layers.RotaryEmbedding(ModelConfig.from_dict(config.to_dict()), 512)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randperm(512, generator=gen)[:tokens]
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv[:, :heads].clone(), qkv[:, heads:heads + kv_heads].clone(), qkv[:, heads + kv_heads:].clone()
    cpu_layers.rotary_(qkv[:, :heads + kv_heads], positions, rope.cos, rope.sin)
    cos, sin = rope.cos[positions], rope.sin[positions]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(qkv[:, :heads], want_q[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads:heads + kv_heads], want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads + kv_heads:], v)  # v untouched


HALF = [torch.bfloat16, torch.float16]


def _half(dtype: torch.dtype) -> None:
    if dtype not in cpu_layers.dtypes():
        pytest.skip(f"built without {dtype}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("rows", "d"), [(1, 64), (7, 100), (300, 1024)])
def test_half_precision_rms_norm_matches_transformers_and_the_float32_reference(dtype, rows, d):
    """Rounded where transformers' bfloat16/float16 LlamaRMSNorm rounds (the normalised row, then its product with
    the weight): its outputs, but for the sum's order, and the float32 reference's within two roundings."""
    _half(dtype)
    gen = torch.Generator().manual_seed(rows + d)
    x, weight = (torch.randn(rows, d, generator=gen) * 3).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(rows, d, generator=gen).to(dtype)
    want_sum = x + residual
    got, got_sum = cpu_layers.rms_norm(x, weight, 1e-5, residual), residual
    assert got.dtype == dtype and torch.equal(got_sum, want_sum)  # PyTorch's add in the dtype, rounded once
    hf = _hf_norm(weight, 1e-5).to(dtype)(want_sum)
    assert (got == hf).float().mean() >= 0.999
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), _hf_norm(weight.float(), 1e-5)(want_sum.float()), rtol=2 * eps, atol=eps)


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_silu_and_mul_matches_pytorch_and_the_float32_reference(dtype):
    _half(dtype)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(45, 2 * 200, generator=gen) * 4).to(dtype)
    x[0, :6] = torch.tensor([-100.0, -88.5, -20.0, 0.0, 20.0, 100.0], dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    got = cpu_layers.silu_and_mul(x)
    assert got.dtype == dtype and (got == F.silu(gate) * up).float().mean() >= 0.999
    eps = torch.finfo(dtype).eps
    # near zero (silu of -88 and below, float16's subnormals) absolute precision only, as in float32
    torch.testing.assert_close(got.float(), F.silu(gate.float()) * up.float(), rtol=2 * eps,
                               atol=max(1e-30, torch.finfo(dtype).smallest_normal))


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_rotary_is_bit_for_bit_transformers(dtype):
    """transformers' bfloat16 rotary (cos and sin cast to the dtype, each product and sum rounded) exactly, and the
    float32 reference within a few roundings."""
    _half(dtype)
    heads, dim, tokens = 6, 64, 29
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    rope = layers.RotaryEmbedding(ModelConfig.from_dict(config.to_dict()), 256)
    gen = torch.Generator().manual_seed(7)
    positions = torch.randperm(256, generator=gen)[:tokens]
    x = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    got = cpu_layers.rotary_(x.clone(), positions, rope.cos, rope.sin)
    cos, sin = rope.cos[positions].to(dtype), rope.sin[positions].to(dtype)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(got, want[0].transpose(0, 1))
    exact, _ = apply_rotary_pos_emb(x.float().transpose(0, 1)[None], x.float().transpose(0, 1)[None],
                                    rope.cos[positions][None], rope.sin[positions][None])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), exact[0].transpose(0, 1), rtol=4 * eps, atol=4 * eps)


def test_the_thread_count_does_not_change_a_bit():
    gen = torch.Generator().manual_seed(4)
    x, residual, weight = (torch.randn(1000, 256, generator=gen) for _ in range(3))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            r = residual.clone()
            results.append((cpu_layers.rms_norm(x, weight[0], 1e-5, r), r, cpu_layers.silu_and_mul(x)))
    finally:
        torch.set_num_threads(before)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: cpu_layers.rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.ones(8), 1e-5), "float32"),
    (lambda: cpu_layers.rms_norm(torch.randn(4, 8).bfloat16(), torch.ones(8), 1e-5), "that of x"),
    (lambda: cpu_layers.rms_norm(torch.randn(4, 8), torch.ones(9), 1e-5), "weight"),
    (lambda: cpu_layers.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-5, torch.zeros(3, 8)), "residual"),
    (lambda: cpu_layers.rms_norm(torch.randn(8, 4).t(), torch.ones(8), 1e-5), "unit column stride"),
    (lambda: cpu_layers.silu_and_mul(torch.randn(4, 7)), "odd"),
    (lambda: cpu_layers.rotary_(torch.randn(2, 1, 8), torch.tensor([0, 1], dtype=torch.int32), torch.ones(4, 8),
                                torch.ones(4, 8)), "int64"),
])
def test_rejects_what_it_cannot_run(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_rotary_refuses_a_position_outside_its_table():
    with pytest.raises(IndexError, match="position 4 is outside the table's 4"):
        cpu_layers.rotary_(torch.randn(2, 1, 8), torch.tensor([0, 4]), torch.ones(4, 8), torch.ones(4, 8))


def test_the_engine_layers_take_the_kernels_on_the_cpu(monkeypatch):
    """RMSNorm with and without the residual, and SiLU-and-mul, agree between the kernel and the PyTorch forms; the
    kernels take bfloat16 too, and never float64."""
    gen = torch.Generator().manual_seed(5)
    norm = layers.RMSNorm(128, 1e-5)
    norm.weight.data.copy_(torch.rand(128, generator=gen))
    x, residual, gate_up = torch.randn(9, 128, generator=gen), torch.randn(9, 128, generator=gen), torch.randn(9, 64)
    fast = (norm(x), *norm(x, residual.clone()), layers.silu_and_mul(gate_up))
    calls = []
    monkeypatch.setattr(cpu_layers, "_extension", lambda: calls.append(1))  # None: the PyTorch forms
    slow = (norm(x), *norm(x, residual.clone()), layers.silu_and_mul(gate_up))
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    assert calls  # the PyTorch forms ran because the kernels were not there
    monkeypatch.undo()
    assert cpu_layers.takes(x.device, x.dtype) and cpu_layers.takes(x.device, torch.bfloat16)
    assert not cpu_layers.takes(x.device, torch.float64)


def test_gemmas_norm_takes_the_kernel_in_float32_only(monkeypatch):
    """Gemma's norm multiplies by (1 + w) before rounding, the kernel after: in bfloat16 it keeps its PyTorch form,
    which is transformers' Gemma2RMSNorm exactly."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from sluice.worker.engine.models.gemma import GemmaRMSNorm

    gen = torch.Generator().manual_seed(8)
    ours, theirs = GemmaRMSNorm(96, 1e-6), Gemma2RMSNorm(96, 1e-6)
    ours.weight.data.copy_(torch.randn(96, generator=gen))
    theirs.weight.data.copy_(ours.weight.data)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=1e-6)  # float32: the kernel
    ours, theirs, x = ours.bfloat16(), theirs.bfloat16(), x.bfloat16()
    calls = []
    monkeypatch.setattr(cpu_layers, "rms_norm", lambda *a: calls.append(a))
    assert torch.equal(ours(x), theirs(x)) and not calls


def test_a_failed_build_is_logged_and_gives_none(monkeypatch, caplog, tmp_path):
    """No compiler (or any build error): a warning naming the source, and None, so the layers use PyTorch ops."""
    import torch.utils.cpp_extension

    from sluice.kernels import cpu_build

    def fail(*args, **kwargs):
        raise OSError("no c++ compiler")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no build made already, which would load as it is
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    assert cpu_build.build.__wrapped__("layers_cpu.cpp", ("-ffp-contract=off",)) is None
    assert "layers_cpu.cpp could not be built (no c++ compiler)" in caplog.text
