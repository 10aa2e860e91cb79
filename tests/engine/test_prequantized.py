"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) against references sluice does not compute.

compressed-tensors checkpoints are made by compressed-tensors itself and loaded by transformers on CPU (symmetric
ones; transformers cannot load asymmetric zero points, so those are dequantized by compressed-tensors' own
CompressedTensorsDequantizer). GPTQ and AWQ have no packer that installs here: a helper below writes their documented
layouts (AutoGPTQ/gptqmodel's and AutoAWQ's GEMM), checked against compressed-tensors' AutoAWQConverter for AWQ and
against the layout's known constants for GPTQ. The reference model is transformers on the dequantized weights.

PyTorch's weight-only CPU kernels take bfloat16 activations, which moves these random models' logits by about 1% and
turns near-ties in greedy decoding; the comparisons run them in float32 instead (the same kernels, the same repacked
buffers), where sluice's logits match to 1e-4 and every greedy token is equal. One test keeps bfloat16.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.demo import build_checkpoint
from sluice.worker.engine.sampling_params import SamplingParams as SP
from sluice.worker.engine.sequence import Sequence

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# K = 256 and 512: two and four groups of 128
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.05)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: slot i of a word holds column ORDER[i] of its 8


@pytest.fixture(autouse=True)
def float32_cpu_kernels(monkeypatch):
    monkeypatch.setattr("sluice.worker.engine.quantization.CPU_KERNEL_DTYPE", torch.float32)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, tokenizer_dir):
    return build_checkpoint(tmp_path_factory.mktemp("float"), "LlamaForCausalLM", seed=11,
                            tokenizer_dir=tokenizer_dir, **SHAPE)


# --- the layouts, written from their documentation --------------------------------------------------------------

def pack_int32(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit values (0..15) eight to an int32 along `dim`, slot i (bits 4i..4i+3) holding position order[i]."""
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = sum(v[..., order[i]] << (4 * i) for i in range(8))
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # the bits of a uint32, stored as int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def quantize_rtn(w: torch.Tensor, group: int, g_idx: torch.Tensor, sym: bool):
    """GPTQ's quantizer without its Hessian updates: w [N, K] -> q [N, K] in 0..15, scales and zeros [groups, N]
    (scales rounded to float16, as stored), each column k in group g_idx[k]."""
    n, k = w.shape
    order = torch.argsort(g_idx, stable=True)
    grouped = w[:, order].reshape(n, k // group, group)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        scale = (2 * hi / 15).half().float()
        zero = torch.full_like(scale, 8)
    else:
        scale = ((hi - lo) / 15).half().float()
        zero = torch.round(-lo / scale)
    s, z = scale.T[g_idx.long()].T, zero.T[g_idx.long()].T  # [N, K]
    q = torch.clamp(torch.round(w / s) + z, 0, 15)
    return q.long(), scale.T, zero.T.long(), (q - z) * s


def gptq_tensors(w: torch.Tensor, group: int, act_order: bool, sym: bool, v1: bool):
    """One projection in AutoGPTQ's layout: qweight [K/8, N] packed along K, qzeros [groups, N/8] packed along N
    (v1: z - 1), scales [groups, N] float16, g_idx [K]; and the weight it dequantizes to."""
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:  # a column order as desc_act makes (by the Hessian's diagonal, one per input: q/k/v share it)
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
    q, scales, zeros, deq = quantize_rtn(w, group, g_idx, sym)
    tensors = {"qweight": pack_int32(q.T, 0), "qzeros": pack_int32(zeros - 1 if v1 else zeros, 1),
               "scales": scales.half(), "g_idx": g_idx}
    return tensors, deq


def awq_tensors(w: torch.Tensor, group: int):
    """One projection in AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [groups, N/8] packed along N in AWQ's
    order, scales [groups, N] float16; and the weight it dequantizes to."""
    k = w.shape[1]
    q, scales, zeros, deq = quantize_rtn(w, group, torch.arange(k) // group, sym=False)
    return {"qweight": pack_int32(q.T, 1, AWQ_ORDER), "qzeros": pack_int32(zeros, 1, AWQ_ORDER),
            "scales": scales.half()}, deq


def write_quantized(float_dir: Path, out: Path, quantization_config: dict, layout) -> tuple[Path, Path]:
    """The checkpoint with every decoder projection in `layout`, and a float twin holding the dequantized weights."""
    ref = out.with_name(out.name + "-dequantized")
    for d in (out, ref):
        shutil.copytree(float_dir, d)
    tensors = load_file(str(float_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        prefix, _, _ = name.rpartition(".")
        if prefix.rsplit(".", 1)[-1] in PROJECTIONS and name.endswith(".weight"):
            parts, deq = layout(t)
            quantized.update({f"{prefix}.{p}": v.contiguous() for p, v in parts.items()})
            dequantized[name] = deq.float().contiguous()
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out, ref


def gptq_config(group: int, act_order: bool, sym: bool = True, fmt: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
            "checkpoint_format": fmt}


# --- compressed-tensors, made by compressed-tensors ---------------------------------------------------------------

def compressed_tensors_checkpoint(float_dir: Path, out: Path, bits: int, strategy: str, symmetric: bool,
                                  fmt: str = "pack-quantized") -> Path:
    """compressed-tensors' own checkpoint: its scheme applied, its min/max qparams, its compressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(str(float_dir))
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, symmetric=symmetric,
                            group_size=128 if strategy == "group" else None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight
            w = w.unflatten(-1, (-1, 128)) if strategy == "group" else w.unsqueeze(1)
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for tokenizer_file in float_dir.glob("tokenizer*"):
        shutil.copy(tokenizer_file, out)
    return out


def dequantized_by_compressed_tensors(ct_dir: Path, float_dir: Path, out: Path) -> Path:
    """The float checkpoint of compressed-tensors' own dequantization of ct_dir."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    shutil.copytree(float_dir, out)
    tensors = load_file(str(ct_dir / "model.safetensors"))
    dense = CompressedTensorsDequantizer(ct_dir, dtype=torch.float32).process(tensors)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --- comparisons --------------------------------------------------------------------------------------------------

def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 500) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    seq = Sequence("probe", ids, SP(), 0.0)
    llm.block_manager.allocate(seq, len(ids))
    try:
        return llm.runner.run([(seq, len(ids))])[0][0]
    finally:
        llm.block_manager.free(seq)


def assert_matches(llm: LLM, reference: Path, tol: float = 1e-4, tokens: int = 8) -> None:
    """Last-token logits within tol (relative to their largest) and greedy tokens equal to transformers'."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    for ids in prompts():
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1].float()
        got = last_logits(llm, ids)
        assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts()]
    out = llm.generate(prompts(), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


# --- tests --------------------------------------------------------------------------------------------------------

def test_the_gptq_helper_writes_the_documented_layout():
    """Symmetric v1 GPTQ stores z - 1 = 7 in every nibble: qzeros words of 0x77777777, as AutoGPTQ's do."""
    w = torch.randn(64, 256) * 0.05
    tensors, deq = gptq_tensors(w, 128, act_order=False, sym=True, v1=True)
    assert (tensors["qzeros"] == 0x77777777).all()
    assert tensors["qweight"].shape == (32, 64) and tensors["scales"].shape == (2, 64)
    # column 9 of row 3 is nibble 1 of qweight[1, 3]
    q = (tensors["qweight"][1, 3].item() >> 4) & 0xF
    scale = tensors["scales"][0, 3].float()
    assert torch.isclose(deq[3, 9], (q - 8) * scale)


@pytest.mark.parametrize("group,act_order,fmt", [(128, False, "gptq"), (-1, False, "gptq"), (128, True, "gptq"),
                                                 (32, True, "gptq_v2")],
                         ids=["g128", "per-channel", "g128-act-order", "g32-act-order-v2"])
def test_gptq_matches_its_dequantized_weights(float_dir, tmp_path, group, act_order, fmt):
    path, ref = write_quantized(float_dir, tmp_path / "gptq", gptq_config(group, act_order, fmt=fmt),
                                lambda w: gptq_tensors(w, group, act_order, sym=True, v1=fmt == "gptq"))
    llm = LLM(str(path), num_kv_blocks=64)
    assert llm.stats()["quantization"] == "gptq-int4"
    layer = llm.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.method.permuted == act_order and not hasattr(layer, "weight")
    assert_matches(llm, ref)


def test_gptq_with_bfloat16_activations(float_dir, tmp_path, monkeypatch):
    """The CPU kernels as they run by default: bfloat16 activations, logits within about 1% (measured 1.2%)."""
    monkeypatch.setattr("sluice.worker.engine.quantization.CPU_KERNEL_DTYPE", torch.bfloat16)
    path, ref = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, True),
                                lambda w: gptq_tensors(w, 128, True, sym=True, v1=True))
    llm = LLM(str(path), num_kv_blocks=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ref))
    for ids in prompts():
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1]
        assert (last_logits(llm, ids) - want).abs().max() <= 0.03 * want.abs().max()


def test_asymmetric_gptq(float_dir, tmp_path):
    path, ref = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, True, sym=False),
                                lambda w: gptq_tensors(w, 128, True, sym=False, v1=True))
    assert_matches(LLM(str(path), num_kv_blocks=64), ref)


def test_gptq_act_order_on_the_triton_backend(float_dir, tmp_path):
    """The permutation of x before the Triton W4A16 kernel (Triton's interpreter on CPU)."""
    path, ref = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, True),
                                lambda w: gptq_tensors(w, 128, True, sym=True, v1=True))
    llm = LLM(str(path), num_kv_blocks=64, linear_backend="triton")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ref))
    ids = prompts(1)[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    got = last_logits(llm, ids)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()  # float32 throughout


def test_awq_matches_compressed_tensors_dequantization(float_dir, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    path, ref = write_quantized(float_dir, tmp_path / "awq", config, lambda w: awq_tensors(w, 128))
    # compressed-tensors reads the same tensors as AutoAWQ GEMM and dequantizes them to the helper's weights (in
    # float16, the scales' dtype: to its precision)
    awq = load_file(str(path / "model.safetensors"))
    converted = AutoAWQConverter(group_size=128).process(dict(awq))
    ct_dir = tmp_path / "awq-as-ct"
    shutil.copytree(float_dir, ct_dir)
    save_file(converted, str(ct_dir / "model.safetensors"))
    ct_config = AutoAWQConverter(group_size=128).update_config(None).model_dump()
    cfg = json.loads((ct_dir / "config.json").read_text())
    (ct_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        **ct_config, "quant_method": "compressed-tensors"}}))
    library = dequantized_by_compressed_tensors(ct_dir, float_dir, tmp_path / "awq-library")
    ours = load_file(str(ref / "model.safetensors"))
    for name, t in load_file(str(library / "model.safetensors")).items():
        torch.testing.assert_close(t, ours[name], rtol=1e-3, atol=1e-6)
    llm = LLM(str(path), num_kv_blocks=64)
    assert llm.stats()["quantization"] == "awq-int4"
    assert_matches(llm, ref)
    # the converted checkpoint is compressed-tensors' asymmetric W4A16: the same weights again
    assert_matches(LLM(str(ct_dir), num_kv_blocks=64), ref)


@pytest.mark.parametrize("bits,strategy,fmt", [(4, "group", "pack-quantized"), (4, "channel", "pack-quantized"),
                                              (8, "channel", "pack-quantized"), (8, "channel", "int-quantized")])
def test_compressed_tensors_loads_as_transformers_does(float_dir, tmp_path, bits, strategy, fmt):
    path = compressed_tensors_checkpoint(float_dir, tmp_path / "ct", bits, strategy, symmetric=True, fmt=fmt)
    llm = LLM(str(path), num_kv_blocks=64)
    assert llm.stats()["quantization"] == f"compressed-tensors-int{bits}"
    assert_matches(llm, path)  # transformers decompresses compressed-tensors checkpoints on CPU


def test_asymmetric_compressed_tensors(float_dir, tmp_path):
    path = compressed_tensors_checkpoint(float_dir, tmp_path / "ct", 4, "group", symmetric=False)
    assert "weight_zero_point" in "".join(load_file(str(path / "model.safetensors")))
    assert_matches(LLM(str(path), num_kv_blocks=64),
                   dequantized_by_compressed_tensors(path, float_dir, tmp_path / "ct-dense"))


def test_prequantized_weights_take_their_packed_bytes(float_dir, tmp_path):
    path, _ = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, False),
                              lambda w: gptq_tensors(w, 128, False, sym=True, v1=True))
    quantized = LLM(str(path), num_kv_blocks=8).stats()["weight_bytes"]
    on_load = LLM(str(float_dir), num_kv_blocks=8, quantization="int4").stats()["weight_bytes"]
    assert quantized == on_load  # the same INT4 buffers, whichever way they came


def test_a_missing_part_is_named(float_dir, tmp_path):
    path, _ = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, True),
                              lambda w: gptq_tensors(w, 128, True, sym=True, v1=True))
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.g_idx"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.g_idx"):
        LLM(str(path), num_kv_blocks=8)


def test_fused_projections_with_different_column_orders_are_refused(float_dir, tmp_path):
    """q, k and v share one x: act-order checkpoints give them one order (the same Hessian); another is refused."""
    path, _ = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, True),
                              lambda w: gptq_tensors(w, 128, True, sym=True, v1=True))
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(256, dtype=torch.int32).flip(0) // 128
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"layers\.0\.self_attn\.[qkv]_proj\.weight: its quantization .* differs"):
        LLM(str(path), num_kv_blocks=8)


def test_quantizing_a_prequantized_checkpoint_is_refused(float_dir, tmp_path):
    path, _ = write_quantized(float_dir, tmp_path / "gptq", gptq_config(128, False),
                              lambda w: gptq_tensors(w, 128, False, sym=True, v1=True))
    with pytest.raises(ValueError, match="already quantized \\(gptq-int4\\)"):
        LLM(str(path), quantization="int8")


RAW = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
       "num_hidden_layers": 1, "num_attention_heads": 2}


def ct(weights: dict, **group) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **group}}}


W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


@pytest.mark.parametrize("quant,error", [
    ({"quant_method": "fp8"}, "quantization method 'fp8' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq checkpoint: 8-bit weights"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq checkpoint: 3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq checkpoint: version 'gemv'"),
    (ct(W4, input_activations={"num_bits": 8, "type": "int"}), "W4A8: activations quantized"),
    (ct({**W4, "num_bits": 2}), "2-bit weights"),
    (ct({"num_bits": 8, "type": "float", "strategy": "tensor"}), "float 8-bit weights"),
    (ct({**W4, "num_bits": 8}), "W8A16 with strategy 'group'"),
    (ct(W4, format="marlin-24"), "format 'marlin-24'"),
])
def test_unsupported_methods_are_refused_by_name(quant, error):
    with pytest.raises(ModelError, match=error):
        ModelConfig.from_dict({**RAW, "quantization_config": quant})
