"""The float32 CPU matmuls through oneDNN (packed, and on the weight as loaded) against F.linear on the same
weights, and where the engine uses each."""

import pytest
import torch
import torch.nn.functional as F

from worker.engine import LLM
from worker.engine.linear import DENSE, ONEDNN_FLOAT32, Linear, PackedFloat32, bucket_rows, can_pack_float32

needs_onednn = pytest.mark.skipif(not can_pack_float32(torch.empty(1)), reason="PyTorch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 300, 513, 2049])
def test_packed_matches_dense(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, [40, 17], bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 96)
    want = F.linear(x, layer.weight, layer.bias)
    layer.method = ONEDNN_FLOAT32
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer.method = PackedFloat32(layer)
    assert not hasattr(layer, "weight")  # the packed form replaces it
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_pad_little():
    sizes = {bucket_rows(rows) for rows in range(1, 4097)}
    assert len(sizes) <= 128  # with ~5 projection shapes, well inside oneDNN's 1024 cached primitives
    for rows in range(1, 8193):
        padded = bucket_rows(rows)
        assert padded >= rows and bucket_rows(padded) == padded  # a bucket size maps to itself
        assert (padded == rows) if rows <= 16 else (padded % 8 == 0)
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
    for rows in (17, 100, 257, 1000):
        assert bucket_rows(rows) > rows
        x = torch.randn(rows, 32)
        got = layer(x)
        assert got.shape == (rows, 24) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_takes_strided_and_batched_inputs():
    torch.manual_seed(0)
    layer = Linear(64, [48])
    torch.nn.init.normal_(layer.weight)
    w = layer.weight.data.clone()
    layer.method = PackedFloat32(layer)
    x = torch.randn(2, 64, 7).transpose(1, 2)  # [2, 7, 64], not contiguous
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_engine_packs_float32_cpu_weights_only(llama_dir, checkpoints):
    fp32 = LLM(str(llama_dir), num_kv_blocks=8)
    bf16 = LLM(str(llama_dir), num_kv_blocks=8, dtype="bfloat16")
    assert all(isinstance(m.method, PackedFloat32) for m in fp32.runner.model.modules() if isinstance(m, Linear))
    assert all(m.method is DENSE for m in bf16.runner.model.modules() if isinstance(m, Linear))
    # the logical weight size, as if dense: packing changes the layout, not what the weights cost
    assert fp32.stats()["weight_bytes"] == 2 * bf16.stats()["weight_bytes"]
    # a tied lm_head shares the embedding: packing it would copy the embedding, so it multiplies the shared tensor
    qwen2 = LLM(str(checkpoints("qwen2")), num_kv_blocks=8)
    lm_head = qwen2.runner.model.lm_head
    assert lm_head.method is ONEDNN_FLOAT32 and lm_head.weight is qwen2.runner.model.model.embed_tokens.weight
    assert isinstance(qwen2.runner.model.model.layers[0].self_attn.qkv_proj.method, PackedFloat32)


def test_cpu_mlp_runs_long_prefills_in_row_chunks_with_the_same_result(monkeypatch):
    from types import SimpleNamespace

    from worker.engine.layers import silu_and_mul
    from worker.engine.models import llama

    torch.manual_seed(0)
    monkeypatch.setattr(llama, "CPU_MLP_ROWS", 16)
    config = SimpleNamespace(hidden_size=32, intermediate_size=48)
    mlp = llama.MLP(config)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(layer.weight)
    x = torch.randn(50, 32)  # three full chunks and a partial one
    want = F.linear(silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
