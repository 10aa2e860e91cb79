"""The float32 CPU matmuls through oneDNN (packed, and on the weight as loaded) and MKL (packed) against F.linear on
the same weights, which the engine uses on which CPU, and where."""

import platform

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import cpu_gemm as sluice_gemm
from sluice.worker.engine import LLM, linear
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.linear import (
    DENSE,
    ONEDNN_FLOAT32,
    Linear,
    PackedMklFloat32,
    PackedOneDnnFloat32,
    PackedSluiceGemm,
    bucket_rows,
    can_pack_float32,
    can_pack_mkl,
    cpu_gemm,
    native_half_gemm,
)

needs_onednn = pytest.mark.skipif(not can_pack_float32(torch.empty(1)), reason="PyTorch built without oneDNN")
needs_mkl = pytest.mark.skipif(not can_pack_mkl(torch.empty(1)), reason="PyTorch built without MKL")
PACKED = [PackedOneDnnFloat32, pytest.param(PackedMklFloat32, marks=needs_mkl)]
ROWS = [0, 1, 3, 16, 17, 64, 65, 300, 513, 2049]


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", PACKED)
def test_packed_matches_dense(packed, bias):
    """One pack serves every row count: MKL's is made for PACK_ROWS rows and must hold for any other."""
    torch.manual_seed(len(ROWS))
    layer = Linear(96, [40, 17], bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    w = layer.weight.data.clone()
    layer.method = packed(layer)
    assert not hasattr(layer, "weight")  # the packed form replaces it
    for rows in ROWS:
        x = torch.randn(rows, 96)
        want = F.linear(x, w, layer.bias)
        got = layer(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", ROWS)
def test_onednn_on_the_weight_as_loaded_matches_dense(rows):
    torch.manual_seed(rows)
    layer = Linear(96, [40, 17], bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 96)
    want = F.linear(x, layer.weight, layer.bias)
    layer.method = ONEDNN_FLOAT32
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_mkl_pack_keeps_no_float_weight():
    """The op is handed a stride-0 stand-in for the original weight: only its shape is read, and it costs nothing."""
    layer = Linear(64, [48])
    method = PackedMklFloat32(layer)
    assert method.shape.shape == (48, 64) and method.shape.stride() == (0, 0)
    assert method.nbytes == 48 * 64 * 4


def test_cpu_gemm_is_mkl_on_intel_and_onednn_elsewhere(monkeypatch):
    monkeypatch.setattr(linear, "can_pack_mkl", lambda w: True)
    for vendor, want in [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")]:
        monkeypatch.setattr(linear, "cpu_vendor", lambda v=vendor: v)
        assert cpu_gemm("auto") == want
        assert cpu_gemm("onednn") == "onednn" and cpu_gemm("mkl") == "mkl"  # a choice is kept
    monkeypatch.setattr(linear, "can_pack_mkl", lambda w: False)
    monkeypatch.setattr(linear, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_gemm("auto") == "onednn"
    with pytest.raises(ValueError, match="cpu_gemm='mkl' needs a PyTorch built with MKL"):
        cpu_gemm("mkl")
    with pytest.raises(ValueError, match="cpu_gemm must be one of auto, sluice, mkl, onednn, got 'blas'"):
        EngineConfig(model="x", cpu_gemm="blas")


def test_cpu_gemm_takes_sluices_own_for_bfloat16_where_built(monkeypatch):
    """'auto' gives bfloat16 to sluice's GEMM where its build has AVX512-BF16 and the CPU no AMX tiles (oneDNN's uses
    them), and keeps float32 on MKL/oneDNN;
    'sluice' asks for it in either dtype and says so where this CPU's build lacks it; MKL has no bfloat16 path."""
    monkeypatch.setattr(linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(linear, "amx", lambda: False)
    monkeypatch.setattr(linear.sluice_gemm, "dtypes", lambda: (torch.bfloat16, torch.float32))
    assert cpu_gemm("auto", torch.bfloat16) == "sluice" and cpu_gemm("auto", torch.float32) == "onednn"
    assert cpu_gemm("sluice", torch.float32) == "sluice" and cpu_gemm("sluice", torch.bfloat16) == "sluice"
    assert cpu_gemm("onednn", torch.bfloat16) == "onednn" and cpu_gemm("auto", torch.float16) == "onednn"
    if can_pack_mkl(torch.empty(1)):
        assert cpu_gemm("mkl", torch.bfloat16) == "onednn"
    monkeypatch.setattr(linear, "amx", lambda: True)  # oneDNN multiplies on AMX tiles; sluice's kernel would not
    assert cpu_gemm("auto", torch.bfloat16) == "onednn" and cpu_gemm("sluice", torch.bfloat16) == "sluice"
    monkeypatch.setattr(linear.sluice_gemm, "dtypes", lambda: ())  # no compiler, or no AVX-512
    assert cpu_gemm("auto", torch.bfloat16) == "onednn"
    with pytest.raises(ValueError, match="cpu_gemm='sluice' needs its torch.bfloat16 kernel"):
        cpu_gemm("sluice", torch.bfloat16)


def test_cpu_vendor_reads_this_machine():
    vendor = linear.cpu_vendor()
    assert vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "")
    assert (vendor != "") == (platform.machine() == "x86_64")


def test_row_buckets_are_few_and_pad_little():
    sizes = {bucket_rows(rows) for rows in range(1, 4097)}
    assert len(sizes) * 5 <= 1024  # the primitives of ~5 projection shapes stay inside oneDNN's cache of 1024
    for rows in range(1, 8193):
        padded = bucket_rows(rows)
        assert padded >= rows and bucket_rows(padded) == padded  # a bucket size maps to itself
        assert (padded == rows) if rows <= 64 else (padded % 8 == 0)
        if rows > 256:
            assert padded - rows <= rows / 16


@needs_onednn
def test_padded_rows_do_not_leak_into_the_result():
    """A row count between buckets runs padded with zero rows: the result has exactly the input's rows, each equal
    to the unpadded product, with the bias added once."""
    torch.manual_seed(0)
    layer = Linear(32, [24], bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.method = ONEDNN_FLOAT32
    for rows in (65, 100, 257, 1000):
        assert bucket_rows(rows) > rows
        x = torch.randn(rows, 32)
        got = layer(x)
        assert got.shape == (rows, 24) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("packed", PACKED)
def test_packed_takes_strided_and_batched_inputs(packed):
    torch.manual_seed(0)
    layer = Linear(64, [48])
    torch.nn.init.normal_(layer.weight)
    w = layer.weight.data.clone()
    layer.method = packed(layer)
    x = torch.randn(2, 64, 7).transpose(1, 2)  # [2, 7, 64], not contiguous
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("gemm, packed", [("onednn", PackedOneDnnFloat32),
                                          pytest.param("mkl", PackedMklFloat32, marks=needs_mkl)])
def test_engine_packs_cpu_weights(llama_dir, checkpoints, gemm, packed):
    """float32 by the chosen GEMM; bfloat16 by oneDNN's where the CPU multiplies it natively, else left dense."""
    fp32 = LLM(str(llama_dir), num_kv_blocks=8, cpu_gemm=gemm)
    bf16 = LLM(str(llama_dir), num_kv_blocks=8, dtype="bfloat16", cpu_gemm=gemm)
    assert all(isinstance(m.method, packed) for m in fp32.runner.model.modules() if isinstance(m, Linear))
    half = PackedOneDnnFloat32 if native_half_gemm(torch.bfloat16) else type(DENSE)
    assert all(isinstance(m.method, half) for m in bf16.runner.model.modules() if isinstance(m, Linear))
    # the logical weight size, as if dense: packing changes the layout, not what the weights cost
    assert fp32.stats()["weight_bytes"] == 2 * bf16.stats()["weight_bytes"]
    # a tied lm_head shares the embedding: packing it would copy the embedding, so it multiplies the shared tensor
    qwen2 = LLM(str(checkpoints("qwen2")), num_kv_blocks=8, cpu_gemm=gemm)
    lm_head = qwen2.runner.model.lm_head
    assert lm_head.method is ONEDNN_FLOAT32 and lm_head.weight is qwen2.runner.model.model.embed_tokens.weight
    assert isinstance(qwen2.runner.model.model.layers[0].self_attn.qkv_proj.method, packed)


def test_cpu_mlp_runs_long_prefills_in_row_chunks_with_the_same_result(monkeypatch):
    from types import SimpleNamespace

    from sluice.worker.engine.layers import silu_and_mul
    from sluice.worker.engine.models import llama

    torch.manual_seed(0)
    monkeypatch.setattr(llama, "CPU_MLP_ROWS", 16)
    config = SimpleNamespace(hidden_size=32, intermediate_size=48)
    mlp = llama.MLP(config)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(layer.weight)
    x = torch.randn(50, 32)  # three full chunks and a partial one
    want = F.linear(silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native_half_gemm(torch.bfloat16), reason="no native bfloat16 GEMM on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bfloat16_weights_against_f_linear(rows):
    torch.manual_seed(0)
    layer = Linear(256, [96], bias=True)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias)
    layer = layer.to(torch.bfloat16)
    w, b = layer.weight.data.float().clone(), layer.bias.data.float()
    layer.method = PackedOneDnnFloat32(layer)
    x = torch.randn(rows, 256).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    # float32 accumulation inside oneDNN, one rounding to bfloat16 at the end
    torch.testing.assert_close(got.float(), F.linear(x.float(), w, b), rtol=1.6e-2, atol=1e-2)


@pytest.mark.skipif(torch.bfloat16 not in sluice_gemm.dtypes(), reason="sluice's GEMM has no bfloat16 here")
@pytest.mark.parametrize("gemm", ["sluice", "onednn"])
def test_engine_packs_bfloat16_for_sluices_gemm_and_fuses_silu(llama_dir, gemm):
    """Every projection of a bfloat16 Llama in sluice's panels, gate_up packed gated; an MLP then takes silu(gate) *
    up from the GEMM, bit for bit what the projection and the SiLU kernel give. The same engine with
    cpu_gemm='onednn' generates within bfloat16's rounding of it (the two sum in different orders)."""
    llm = LLM(str(llama_dir), num_kv_blocks=8, dtype="bfloat16", cpu_gemm=gemm)
    linears = [m for m in llm.runner.model.modules() if isinstance(m, Linear)]
    want = PackedSluiceGemm if gemm == "sluice" else PackedOneDnnFloat32
    assert all(isinstance(m.method, want) for m in linears)
    mlp = llm.runner.model.model.layers[0].mlp
    if gemm == "sluice":
        assert mlp.gate_up_proj.method.packed.gated
        assert not llm.runner.model.model.layers[0].self_attn.qkv_proj.method.packed.gated
    x = torch.randn(37, mlp.gate_up_proj.in_features).bfloat16()
    unfused = mlp.act(mlp.gate_up_proj(x))
    assert torch.equal(mlp.gated(x), unfused)
    if gemm == "sluice":
        fused = mlp.gate_up_proj.method.fused_silu_and_mul(mlp.gate_up_proj, x)
        assert fused is not None and torch.equal(fused, unfused)
    assert llm.stats()["weight_bytes"] == LLM(str(llama_dir), num_kv_blocks=8, dtype="bfloat16",
                                              cpu_gemm="onednn").stats()["weight_bytes"]


@pytest.mark.skipif(not native_half_gemm(torch.bfloat16), reason="no native bfloat16 GEMM on this CPU")
@pytest.mark.parametrize("gemm", ["auto", "onednn"])
def test_bfloat16_engine_against_transformers(llama_dir, gemm):
    """The bfloat16 engine (sluice's GEMM where built for AVX512-BF16, else oneDNN's; then oneDNN's) against
    transformers' bfloat16 forward: logits within bfloat16's rounding of the float32 ones, greedy tokens agreeing
    on at least 95% of positions (teacher-forced)."""
    import transformers


    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.bfloat16)
    llm = LLM(str(llama_dir), dtype="bfloat16", cpu_gemm=gemm)
    prompt = list(range(5, 70))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].float()
    got = llm.prompt_logits(prompt)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    prompts = [[5 + (i * 13 + j * 7) % 400 for j in range(10 + i)] for i in range(12)]
    agree = total = 0
    for ids in prompts:  # teacher-forced: at each position of transformers' greedy continuation, the same argmax
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        mine = llm.prompt_logits(ids + ref)[len(ids) - 1:-1].argmax(-1).tolist()
        agree, total = agree + sum(a == b for a, b in zip(mine, ref)), total + len(ref)
    assert agree >= 0.95 * total, (agree, total)


@pytest.mark.skipif(torch.float32 not in sluice_gemm.dtypes(), reason="sluice's GEMM has no float32 here")
def test_float32_engine_on_sluices_gemm_when_asked(llama_dir):
    """cpu_gemm='sluice' takes float32 too: the same logits as oneDNN's GEMM within float32 summation order."""
    ours = LLM(str(llama_dir), num_kv_blocks=8, cpu_gemm="sluice")
    assert all(isinstance(m.method, PackedSluiceGemm) for m in ours.runner.model.modules() if isinstance(m, Linear))
    theirs = LLM(str(llama_dir), num_kv_blocks=8, cpu_gemm="onednn")
    prompt = list(range(5, 60))
    torch.testing.assert_close(ours.prompt_logits(prompt), theirs.prompt_logits(prompt), rtol=1e-4, atol=1e-4)
