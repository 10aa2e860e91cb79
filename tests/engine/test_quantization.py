"""INT8/INT4 weights and the INT8 KV cache in the engine: every matmul path against its dequantized reference,
the bytes the weights occupy, quality bounds measured on the test models, and the Triton backends end to end."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.quant import dequantize_int4, dequantize_int8
from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.demo import build_checkpoint
from sluice.worker.engine.linear import Linear
from sluice.worker.engine.quantization import CPU_INT8_MAX_ROWS, Int4Method, Int8Method, quantize_model

PROMPTS = ["Beautiful is better than ugly. Explicit is better than implicit.",
           "Errors should never pass silently. Unless explicitly silenced.",
           "Now is better than never. Although never is often better than right now.",
           "If the implementation is hard to explain, it's a bad idea."]


def layer(n: int, k: int, bias: bool = False) -> Linear:
    torch.manual_seed(n * 1000 + k)
    lin = Linear(k, [n], bias=bias)
    lin.weight.data.normal_(0, 0.05)
    if bias:
        lin.bias.data.normal_(0, 0.05)
    return lin


def reference(lin: Linear, x: torch.Tensor, kind: str, group: int = 32) -> torch.Tensor:
    if kind == "int8":
        w = dequantize_int8(lin.qweight, lin.scale)
    elif hasattr(lin, "scales"):
        w = dequantize_int4(lin.qweight, lin.scales, lin.zeros, group)
    else:  # CPU kernel packing: rebuild the canonical form from a second quantization of the same weight
        raise AssertionError("reference needs canonical int4 buffers")
    y = x.float() @ w.float().T
    return y if lin.bias is None else y + lin.bias.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, CPU_INT8_MAX_ROWS, CPU_INT8_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("k", [64, 72])  # 72: not a whole number of 32s, so never the CPU kernel
def test_int8_cpu_paths_match_the_dequantized_weight(rows, k):
    lin = layer(48, k, bias=True)
    method = Int8Method("torch")
    method.quantize(lin)
    lin.method = method
    assert method.cpu_kernel == (k % 32 == 0)
    x = torch.randn(rows, k)
    # the CPU paths compute in bfloat16 (16-bit activations): about 3 significant digits
    assert rel_err(lin(x), reference(lin, x, "int8")) < 1e-2


def test_int4_cpu_kernel_and_fallback_match_the_dequantized_weight():
    for n, uses_kernel in [(48, True), (40, False)]:  # the CPU kernel packs 16 output rows at a time
        lin, canonical = layer(n, 64), layer(n, 64)
        kernel_method, plain = Int4Method("torch", 32), Int4Method("triton", 32)
        kernel_method.quantize(lin)
        lin.method = kernel_method
        plain.quantize(canonical)  # the canonical buffers of the same weight, for the reference
        assert kernel_method.cpu_kernel == uses_kernel
        for rows in (1, 5, 40):
            x = torch.randn(rows, 64)
            assert rel_err(lin(x), reference(canonical, x, "int4")) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_keeps_a_constant_output_channel(dtype):
    # an output channel whose weights are all 0.01: every group constant, which int4 must keep (it came back as 0)
    lin = layer(48, 64)
    lin.weight.data[5] = 0.01
    lin = lin.to(dtype)
    w = lin.weight.data.float().clone()
    method = Int4Method("torch", 32)
    method.quantize(lin)
    lin.method = method
    assert method.cpu_kernel
    x = torch.randn(4, 64).to(dtype)
    want = x.float() @ w[5]
    torch.testing.assert_close(lin(x)[:, 5].float(), want, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_triton_linear_backend_matches_the_dequantized_weight(kind):
    lin = layer(40, 64, bias=True)
    method = Int8Method("triton") if kind == "int8" else Int4Method("triton", 32)
    method.quantize(lin)
    lin.method = method
    for rows in (1, 3, 33):
        x = torch.randn(rows, 64)
        assert rel_err(lin(x), reference(lin, x, kind)) < 1e-5  # float32 throughout


def test_weight_bytes_of_a_bench_shaped_model(tmp_path, tokenizer_dir):
    """The bench Llama's proportions at half its width: int8 <= 55% and int4 <= 30% of the bf16 bytes."""
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=0, dtype="bfloat16", tokenizer_dir=tokenizer_dir,
                            hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408,
                            num_hidden_layers=8, vocab_size=2048)
    bf16 = LLM(str(path), num_kv_blocks=8).stats()["weight_bytes"]
    int8 = LLM(str(path), num_kv_blocks=8, quantization="int8").stats()["weight_bytes"]
    int4 = LLM(str(path), num_kv_blocks=8, quantization="int4").stats()["weight_bytes"]
    int4_head = LLM(str(path), num_kv_blocks=8, quantization="int4", quantize_lm_head=True).stats()["weight_bytes"]
    assert int8 <= 0.55 * bf16
    assert int4 <= 0.34 * bf16  # embeddings and lm_head stay bf16 by default: they are 17% of this model
    assert int4_head <= 0.30 * bf16


def test_weight_bytes_are_the_packed_sizes(llama_dir):
    base = LLM(str(llama_dir), num_kv_blocks=8)
    q8 = LLM(str(llama_dir), num_kv_blocks=8, quantization="int8")
    quantized = [m for n, m in base.runner.model.named_modules() if isinstance(m, Linear) and "lm_head" not in n]
    rows = sum(sum(m.out_sizes) for m in quantized)
    params = sum(sum(m.out_sizes) * m.in_features for m in quantized)
    # float32 model: every quantized weight goes from 4 bytes to 1, plus one float32 scale per output row
    assert base.stats()["weight_bytes"] - q8.stats()["weight_bytes"] == params * 3 - rows * 4


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_quantized_quality_on_the_test_models(checkpoints, arch):
    """Bounds from bench/quant_quality.py's measurements on these models (README): int8 logits within 0.5-0.7% and
    top-1 98.7-100% of the float model; int4 g32 within 6.3-7.7% and 87-100%. Bounds leave about 2x margin."""
    path = checkpoints(arch)
    ref = LLM(str(path), num_kv_blocks=64)
    for quant, max_err, min_agree in [(dict(quantization="int8"), 0.015, 0.95),
                                      (dict(quantization="int4", quantization_group_size=32), 0.15, 0.75)]:
        llm = LLM(str(path), num_kv_blocks=64, **quant)
        errs, agree, total = [], 0, 0
        for text in PROMPTS:
            a, b = ref.prompt_logits(text), llm.prompt_logits(text)
            errs.append(rel_err(b, a))
            agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
            total += a.shape[0]
        assert max(errs) < max_err, (quant, errs)
        assert agree / total >= min_agree, (quant, agree / total)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 8 for o in outs)
        assert llm.stats()["kv_blocks_used"] == 0


def test_int4_needs_a_group_size_dividing_the_layers(llama_dir):
    with pytest.raises(ValueError, match="in_features 160 is not a multiple of int4 group_size 64"):
        LLM(str(llama_dir), quantization="int4", quantization_group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_model(torch.nn.Module(), "int4", 48, "torch")


def test_triton_attention_backend_gives_the_same_tokens(llama_dir):
    prompts = [[5 + (i * 13 + j) % 400 for j in range(3 + i * 7)] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    # prefix hits, chunked prefill (budget 16) and mixed decode/prefill steps all go through the kernels
    prompts += [prompts[-1] + [7, 8, 9]]
    kwargs = dict(num_kv_blocks=48, max_num_batched_tokens=16)
    torch_out = LLM(str(llama_dir), **kwargs).generate(prompts, params)
    triton = LLM(str(llama_dir), attention_backend="triton", **kwargs)
    triton_out = triton.generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    assert triton.stats()["prefix_cache_hits"] > 0


def test_int8_kv_cache_holds_about_twice_the_tokens(tmp_path, tokenizer_dir):
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=0, dtype="bfloat16", tokenizer_dir=tokenizer_dir,
                            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
                            head_dim=128)
    memory = 4 << 20
    bf16 = LLM(str(path), kv_cache_memory=memory).stats()
    int8 = LLM(str(path), kv_cache_memory=memory, kv_cache_dtype="int8").stats()
    assert int8["kv_cache_dtype"] == "int8" and bf16["kv_cache_dtype"] == "bfloat16"
    assert int8["kv_cache_tokens"] >= 1.9 * bf16["kv_cache_tokens"]  # head_dim 128: 132 bytes vs 256 per head
    assert int8["kv_cache_bytes"] <= memory


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_int8_kv_cache_quality(checkpoints, arch):
    """Measured on these models: logits within 0.22-0.34% of the float cache's, top-1 99.2-100% (teacher-forced)."""
    path = checkpoints(arch)
    ref, kv8 = LLM(str(path), num_kv_blocks=64), LLM(str(path), num_kv_blocks=64, kv_cache_dtype="int8")
    agree = total = 0
    for text in PROMPTS:
        a, b = ref.prompt_logits(text), kv8.prompt_logits(text)
        assert rel_err(b, a) < 0.01
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
    assert agree / total >= 0.97


def test_int8_kv_cache_is_read_the_same_by_both_backends(llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    torch_kv8 = LLM(str(llama_dir), num_kv_blocks=64, kv_cache_dtype="int8").generate(PROMPTS, params)
    triton_kv8 = LLM(str(llama_dir), num_kv_blocks=64, kv_cache_dtype="int8", attention_backend="triton")
    assert [o.token_ids for o in triton_kv8.generate(PROMPTS, params)] == [o.token_ids for o in torch_kv8]


def test_sluice_run_takes_the_quantization_flags(tmp_path, llama_dir):
    import json

    from sluice.worker.cli import main

    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "Simple is better", "max_tokens": 4, "temperature": 0}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(llama_dir),
                 "--quantization", "int4", "--quantization-group-size", "32", "--kv-cache-dtype", "int8"])
    assert code == 0
    out = json.loads((tmp_path / "out.jsonl").read_text())
    assert out["response"]["body"]["usage"]["completion_tokens"] == 4
