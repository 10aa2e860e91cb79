"""Mixtral and Qwen3-MoE: greedy tokens equal transformers' generate (ample cache with prefix-cache hits,
preemption, chunked prefill); INT8/INT4 experts equal transformers on the engine's own dequantized weights; every
expert path against transformers' expert module, routing against its routers; configs the engine refuses."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_bounded_loading import MARGIN, largest_tensor_bytes, load_measured
from test_greedy import hf_greedy, make_prompts, run_engine
from torch import nn

from sluice.kernels.quant import dequantize_int4, dequantize_int8, quantize_int8
from sluice.worker.engine import LLM, SamplingParams, fused_moe, quantization
from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.fused_moe import FusedExperts, route
from sluice.worker.engine.linear import Linear
from sluice.worker.engine.models.moe import MoeConfig

NUM_PROMPTS = 16


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_case(request, checkpoints):
    path = checkpoints(request.param)
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = make_prompts(vocab, seed=11, shared_prefix=40)[:NUM_PROMPTS]
    return path, prompts, hf_greedy(path, prompts)


def test_ample_cache_with_prefix_hits(moe_case):
    path, prompts, expected = moe_case
    got, stats, planned = run_engine(path, prompts, max_num_seqs=8)
    assert got == expected
    assert stats["prefix_cache_hits"] >= (NUM_PROMPTS - 8) * 32  # the shared prefix's two full blocks
    assert max(len(step) for step in planned) > 1, "requests were not batched"


def test_preemption_keeps_outputs(moe_case):
    path, prompts, expected = moe_case
    got, stats, _ = run_engine(path, prompts, num_kv_blocks=16)
    assert stats["num_preemptions"] > 0
    assert got == expected


def test_chunked_prefill(moe_case):
    path, prompts, expected = moe_case
    got, _, planned = run_engine(path, prompts, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert got == expected
    assert all(sum(n for _, n in step) <= 16 for step in planned)


def _dequantized_experts(m: FusedExperts, name: str, group: int) -> torch.Tensor:
    """The experts' weight rows [E * N, K] from their INT8/INT4 buffers, by kernels/quant.py."""
    q = getattr(m, f"{name}_qweight").flatten(0, 1)
    if m.mode == "int8":
        return dequantize_int8(q, getattr(m, f"{name}_scale").flatten())
    scales, zeros = (getattr(m, f"{name}_{part}").flatten(0, 1) for part in ("scales", "zeros"))
    return dequantize_int4(q, scales, zeros, group)


def dequantized_checkpoint(llm: LLM, src, dst):
    """src with every weight the engine quantized replaced by its dequantized value (kernels/quant.py)."""
    model, group = llm.runner.model, llm.config.quantization_group_size
    for module in model.modules():
        if isinstance(module, FusedExperts) and module.mode:
            for n in ("w13", "w2"):
                setattr(module, n, nn.Parameter(_dequantized_experts(module, n, group), requires_grad=False))
        elif isinstance(module, Linear) and hasattr(module, "qweight"):
            w = (dequantize_int8(module.qweight, module.scale) if hasattr(module, "scale") else
                 dequantize_int4(module.qweight, module.scales, module.zeros, group))
            module.weight = nn.Parameter(w, requires_grad=False)
    tensors = load_file(str(src / "model.safetensors"))
    # the weights the engine still holds as loaded (packed float32 ones are absent here) come back as they were
    tensors.update({name: (p if rows is None else p[rows]).contiguous() for name, (p, rows) in
                    model.checkpoint_tensors().items()})
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("arch, mode, backend", [
    ("mixtral", "int8", "torch"), ("qwen3_moe", "int4", "torch"),  # experts only: the others' CPU kernels take bf16
    ("mixtral", "int4", "triton"), ("qwen3_moe", "int8", "triton"),  # every projection, kernels in float32
])
def test_quantized_experts_equal_transformers_on_their_dequantized_weights(checkpoints, tmp_path, monkeypatch,
                                                                           arch, mode, backend):
    path = checkpoints(arch)
    if backend == "torch":  # quantize the experts alone
        monkeypatch.setattr(quantization, "QUANTIZED_LAYERS", ())
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = [(ids, min(m, 10)) for ids, m in make_prompts(vocab, seed=5)[1:5]]
    llm = LLM(str(path), quantization=mode, quantization_group_size=32, linear_backend=backend)
    experts = [m for m in llm.runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.mode == mode and not hasattr(m, "w13") for m in experts)
    outs = llm.generate([ids for ids, _ in prompts], [SamplingParams(max_tokens=m, temperature=0) for _, m in prompts])
    reference = dequantized_checkpoint(llm, path, tmp_path / "dequantized")
    assert [o.token_ids for o in outs] == hf_greedy(reference, prompts)


@pytest.mark.parametrize("arch, mode", [("mixtral", "int4"), ("qwen3_moe", "int8")])
def test_experts_quantized_on_load_equal_quantizing_the_float_ones(checkpoints, monkeypatch, arch, mode):
    """Each expert tensor quantized into its rows as it loads: the buffers quantize() makes of the loaded float
    experts, byte for byte."""
    path = checkpoints(arch)
    with monkeypatch.context() as patch:  # quantize_model finds the experts quantized already: never in float
        quantize = FusedExperts.quantize
        patch.setattr(FusedExperts, "quantize", lambda self, *a: quantize(self, *a) if self.mode else
                      pytest.fail("experts loaded in float"))
        on_load = LLM(str(path), quantization=mode, quantization_group_size=32)
    after = LLM(str(path))
    pairs = list(zip(*([m for m in llm.runner.model.modules() if isinstance(m, FusedExperts)]
                       for llm in (on_load, after)), strict=True))
    assert pairs
    for ours, theirs in pairs:
        theirs.quantize(mode, 32 if mode == "int4" else 0, on_load.config.backend("linear_backend"))
        assert not hasattr(ours, "w13") and not list(ours.parameters())
        assert (ours.mode, ours.group_size, ours.backend) == (theirs.mode, theirs.group_size, theirs.backend)
        buffers, want = dict(ours.named_buffers()), dict(theirs.named_buffers())
        assert buffers.keys() == want.keys() and len(buffers) == (2 if mode == "int8" else 3) * 2
        for name, b in buffers.items():
            assert b.dtype == want[name].dtype and torch.equal(b, want[name]), name


MOE_BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                       max_position_embeddings=2048)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_int4_experts_load_at_their_weights_plus_one_float_tensor(tmp_path, tokenizer_dir, llama_dir):
    """Experts are 94% of this model's float weights (96 MiB of float32 experts, 12 MiB of INT4 ones): quantized
    after loading in float they peaked at about their float size."""
    from sluice.worker.engine.demo import build_checkpoint

    path = build_checkpoint(tmp_path / "moe", "MixtralForCausalLM", seed=0, tokenizer_dir=tokenizer_dir,
                            **MOE_BENCH_SHAPE)
    m = load_measured(str(llama_dir), str(path), quantization="int4")
    assert m["after"] - m["before"] >= 0.9 * m["weight_bytes"]
    bound = m["weight_bytes"] + largest_tensor_bytes(path) + MARGIN
    assert m["peak"] - m["before"] <= bound, {k: v >> 20 for k, v in m.items()}


def _hf_config(arch: str, **kw):
    cls = transformers.MixtralConfig if arch == "mixtral" else transformers.Qwen3MoeConfig
    return cls(hidden_size=32, intermediate_size=32, moe_intermediate_size=32, num_experts_per_tok=3,
               num_local_experts=6, num_attention_heads=4, **kw)


@pytest.mark.parametrize("arch, norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_routing_matches_transformers(arch, norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = _hf_config(arch, norm_topk_prob=norm)
    router = (MixtralTopKRouter if arch == "mixtral" else Qwen3MoeTopKRouter)(config)
    nn.init.normal_(router.weight)
    x = torch.randn(50, 32)
    _, want_weights, want_ids = router(x)
    weights, ids = route(x @ router.weight.T, 3, norm)
    order = want_ids.argsort(dim=-1)
    assert torch.equal(ids, want_ids.gather(1, order))
    torch.testing.assert_close(weights, want_weights.gather(1, order).float())


@pytest.fixture
def experts_case():
    """Random experts and routing, with transformers' MixtralExperts on the same weights as the reference."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    ours = FusedExperts(6, 32, 32)
    ours.w13.normal_(0, 0.2)
    ours.w2.normal_(0, 0.2)
    x = torch.randn(41, 32)
    weights, ids = route(torch.randn(41, 6), 3, True)
    ids[:20] = ids[0]  # some experts get many rows, some may get none

    def reference(w13, w2):
        hf = MixtralExperts(_hf_config("mixtral"))
        hf.gate_up_proj.data, hf.down_proj.data = w13.float().view(6, 64, 32), w2.float().view(6, 32, 32)
        return hf(x, ids, weights)

    return ours, x, weights, ids, reference


@pytest.mark.parametrize("path", ["grouped_mm", "per_expert_gemm", "triton"])
def test_float_expert_paths_match_transformers(experts_case, monkeypatch, path):
    ours, x, weights, ids, reference = experts_case
    monkeypatch.setattr(fused_moe, "GROUPED_MM", path == "grouped_mm" and fused_moe.GROUPED_MM)
    ours.backend = "triton" if path == "triton" else "torch"
    torch.testing.assert_close(ours(x, weights, ids), reference(ours.w13, ours.w2), atol=1e-5, rtol=1e-5)
    assert ours(x[:0], weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantized_expert_paths_match_transformers_on_dequantized_weights(experts_case, mode, backend):
    ours, x, weights, ids, reference = experts_case
    w13 = ours.stacked("w13").clone()
    ours.quantize(mode, 32, backend)
    dequantized = ours.dequantized("w13"), ours.dequantized("w2")
    assert 0 < (dequantized[0] - w13).abs().max() < 0.1  # the weights, quantized
    torch.testing.assert_close(ours(x, weights, ids), reference(*dequantized), atol=1e-5, rtol=1e-5)


def test_int8_experts_store_per_expert_per_channel_scales():
    experts = FusedExperts(3, 32, 16)
    experts.w13.normal_()
    experts.w2.normal_()
    w2 = experts.stacked("w2").clone()
    experts.quantize("int8", 0, "torch")
    q, s = quantize_int8(w2[1])
    assert torch.equal(experts.w2_qweight[1], q) and torch.equal(experts.w2_scale[1], s)
    with pytest.raises(ValueError, match="in_features 16 is not a multiple of int4 group_size 32"):
        FusedExperts(3, 32, 16).quantize("int4", 32, "torch")


def _config(arch: str, **raw) -> ModelConfig:
    base = dict(architectures=[arch], vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_experts_per_tok=2, moe_intermediate_size=16, num_local_experts=4)
    return ModelConfig.from_dict({k: v for k, v in {**base, **raw}.items() if v is not None})  # None: absent


def test_config_fields():
    m = MoeConfig.of(_config("MixtralForCausalLM"))
    assert (m.num_experts, m.top_k, m.intermediate_size, m.renormalize) == (4, 2, 48, True)
    assert m.sparse_layers == {0, 1, 2, 3}
    raw = dict(num_local_experts=None, num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    m = MoeConfig.of(_config("Qwen3MoeForCausalLM", **raw))
    assert (m.num_experts, m.intermediate_size, m.renormalize, m.sparse_layers) == (8, 16, True, {1})
    # windows as transformers reads them: Mixtral's when given, Qwen3-MoE's only under use_sliding_window
    assert _config("MixtralForCausalLM", sliding_window=16).sliding_window == 16
    assert _config("Qwen3MoeForCausalLM", sliding_window=16).sliding_window is None
    assert _config("Qwen3MoeForCausalLM", sliding_window=16, use_sliding_window=True).sliding_window == 16


def test_stacked_expert_tensors_are_refused_by_name(checkpoints, tmp_path):
    """transformers' save_pretrained(save_original_format=False) keeps its in-memory stacked experts
    (mlp.experts.gate_up_proj): not a layout the engine reads, said by name rather than loaded wrong."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints("qwen3_moe")))
    model.save_pretrained(str(tmp_path), save_original_format=False)
    with pytest.raises(ModelError, match="unexpected tensor model.layers.0.mlp.experts"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("arch, raw, message", [
    ("MixtralForCausalLM", dict(num_experts_per_tok=None), "needs 'num_experts_per_tok'"),
    ("MixtralForCausalLM", dict(num_local_experts=None), "needs 'num_experts'"),
    ("MixtralForCausalLM", dict(num_experts_per_tok=5), "num_experts_per_tok 5 must be from 1 to the 4 experts"),
    ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=None), "needs 'moe_intermediate_size'"),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1"),
])
def test_refused_configs(arch, raw, message):
    with pytest.raises(ModelError, match=message):
        MoeConfig.of(_config(arch, **raw))
