"""Many LoRA adapters on one base model: greedy tokens equal transformers with PEFT (adapters unmerged, and merged as a
second check) for adapters of three ranks mixed with the base model in every batch, under preemption, chunked
prefill, prefix caching and slot eviction; bad adapters are refused naming the adapter and the problem."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_greedy import make_prompts

from sluice.worker.engine import LLM, LoRARequest, SamplingParams
from sluice.worker.engine.config import ModelError
from sluice.worker.engine.demo import build_checkpoint, build_lora_adapter

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (rank, alpha, targets, rsLoRA): different ranks, target sets and scalings
    "qv4": (4, 8, ("q_proj", "v_proj"), False),
    "all8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp16": (16, 32, ("o_proj", "gate_proj", "up_proj", "down_proj"), True),
}
REGIMES = {
    "plain": {},
    "preemption": dict(num_kv_blocks=24, block_size=8, max_num_seqs=8),
    "chunked_prefill": dict(max_num_batched_tokens=24),
}


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_lora_adapter(llama_dir, root / name, rank=r, alpha=alpha, targets=targets, seed=i + 1,
                                     use_rslora=rs)
            for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}


def requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def peft_greedy(base_dir, adapters, cases, **load) -> list[list[int]]:
    """transformers with PEFT, each prompt under its adapter (None: adapters disabled)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, **load)
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    outs = []
    for (ids, max_new), name in cases:
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    outs.append(_greedy(model, ids, max_new))
            else:
                model.set_adapter(name)
                outs.append(_greedy(model, ids, max_new))
    return outs


def _greedy(model, ids, max_new) -> list[int]:
    eos = model.config.eos_token_id
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def run(path, adapters, cases, **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), enable_lora=True, max_lora_rank=16, **engine)
    lora = requests(adapters)
    outs = llm.generate([ids for (ids, _), _ in cases], [SamplingParams(max_tokens=m, temperature=0)
                                                         for (_, m), _ in cases],
                        lora_request=[None if name is None else lora[name] for _, name in cases])
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished_requests()
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def mixed(llama_dir, adapters):
    """Prompts spread over the base model and the three adapters, and PEFT's greedy tokens for them."""
    vocab = transformers.AutoConfig.from_pretrained(str(llama_dir)).vocab_size
    names = [None, *ADAPTERS]
    cases = [(p, names[i % len(names)]) for i, p in enumerate(make_prompts(vocab, seed=7)[:16])]
    return cases, peft_greedy(llama_dir, adapters, cases)


@pytest.mark.parametrize("regime", REGIMES)
def test_mixed_adapters_equal_peft(llama_dir, adapters, mixed, regime):
    cases, expected = mixed
    got, llm = run(llama_dir, adapters, cases, **REGIMES[regime])
    assert got == expected
    by_adapter = {name: [t for t, (_, n) in zip(got, cases) if n == name] for name in (None, *ADAPTERS)}
    assert len({json.dumps(v) for v in by_adapter.values()}) == 4, "the adapters do not change the outputs"
    if regime == "preemption":
        assert llm.stats()["num_preemptions"] > 0


def test_slots_evicted_least_recently_used_and_each_adapter_read_once(llama_dir, adapters, mixed, monkeypatch):
    """Three adapters through two device slots: the scheduler keeps a step within max_loras, the manager evicts the
    least recently used, and no adapter is read from disk twice."""
    from sluice.worker.engine import lora_layers

    reads = []
    load = lora_layers.load_adapter
    monkeypatch.setattr(lora_layers, "load_adapter", lambda name, *a, **k: (reads.append(name), load(name, *a, **k))[1])
    cases, expected = mixed
    got, llm = run(llama_dir, adapters, cases, max_loras=2, max_num_seqs=6)
    assert got == expected
    assert sorted(reads) == sorted(ADAPTERS)
    again = llm.generate([cases[1][0][0]], SamplingParams(max_tokens=cases[1][0][1], temperature=0),
                         lora_request=requests(adapters)[cases[1][1]])[0]
    assert again.token_ids == expected[1] and sorted(reads) == sorted(ADAPTERS)


def test_merged_weights_agree(llama_dir, adapters, mixed, tmp_path):
    """Second reference: each adapter merged into the base weights by PEFT, loaded by the engine as a plain model."""
    cases, expected = mixed
    for name in ADAPTERS:
        base = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
        merged = peft.PeftModel.from_pretrained(base, str(adapters[name])).merge_and_unload()
        merged.save_pretrained(str(tmp_path / name))
        transformers.AutoTokenizer.from_pretrained(str(llama_dir)).save_pretrained(str(tmp_path / name))
        mine = [(p, n) for p, n in cases if n == name]
        out = LLM(str(tmp_path / name)).generate([ids for (ids, _), _ in mine],
                                                 [SamplingParams(max_tokens=m, temperature=0) for (_, m), _ in mine])
        assert [o.token_ids for o in out] == [e for e, (_, n) in zip(expected, cases) if n == name]


def test_prefix_cache_is_shared_within_an_adapter_never_across(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=16, block_size=8)
    lora = requests(adapters)
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(adapter):
        return llm.generate([prompt], params, lora_request=adapter)[0].num_cached_tokens

    assert cached(lora["qv4"]) == 0
    assert cached(lora["all8"]) == 0 and cached(None) == 0  # another adapter, the base: their own KV
    assert cached(lora["qv4"]) == 32 and cached(lora["all8"]) == 32 and cached(None) == 32


def test_n_choices_and_seeds_under_an_adapter(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=16, block_size=8)
    lora = requests(adapters)["all8"]
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3)
    out = llm.generate([prompt], params, lora_request=lora)[0]
    for i, choice in enumerate(out.choices):
        lone = SamplingParams(max_tokens=8, temperature=1.0, seed=3 + i)
        assert choice.token_ids == llm.generate([prompt], lone, lora_request=lora)[0].token_ids


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_weights_with_adapters(llama_dir, adapters, tmp_path, quantization):
    """The LoRA products on top of INT8/INT4 base weights: logits equal PEFT's over the engine's own dequantized
    weights, within the bfloat16 activations' rounding and far inside each adapter's own effect."""
    from sluice.kernels.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    group = 32  # divides the tiny model's 64 and 160 input features
    dequantized = {"int8": lambda w: dequantize_int8(*quantize_int8(w)),
                   "int4": lambda w: dequantize_int4(*quantize_int4(w, group), group)}[quantization]
    dequant = tmp_path / "dequant"
    build_checkpoint(dequant, "LlamaForCausalLM", seed=1, tokenizer_dir=llama_dir, num_key_value_heads=2)
    tensors = load_file(str(llama_dir / "model.safetensors"))
    for key, w in tensors.items():
        if key.rsplit(".", 2)[-2] in ADAPTERS["all8"][2]:
            tensors[key] = dequantized(w).to(w.dtype)
    save_file(tensors, str(dequant / "model.safetensors"), metadata={"format": "pt"})
    base = transformers.AutoModelForCausalLM.from_pretrained(str(dequant), dtype=torch.float32)
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=16, quantization=quantization,
              quantization_group_size=group)
    prompt = list(range(5, 60))
    with torch.no_grad():
        plain = base(torch.tensor([prompt])).logits[0]
    for name, request in requests(adapters).items():
        model = peft.PeftModel.from_pretrained(base, str(adapters[name]))
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0]
        got = llm.prompt_logits(prompt, request)
        error, effect = (got - expected).abs().max(), (expected - plain).abs().max()
        assert error < 0.05 * effect, (name, error, effect)
        base = model.unload()


def test_bad_adapters_are_refused_naming_them(llama_dir, adapters, tmp_path):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=2)
    other = build_checkpoint(tmp_path / "wide", "LlamaForCausalLM", seed=2, tokenizer_dir=llama_dir,
                             hidden_size=96, num_key_value_heads=2)
    wrong = build_lora_adapter(other, tmp_path / "wrong", rank=4, targets=("q_proj",))
    embed = build_lora_adapter(llama_dir, tmp_path / "embed", rank=4, targets=("q_proj", "embed_tokens"))
    cases = [
        (LoRARequest("wrong", 1, str(wrong)), "adapter 'wrong': model.layers.0.self_attn.q_proj has A (4, 96)"),
        (LoRARequest("missing", 2, str(tmp_path / "nowhere")), "adapter 'missing': .*adapter_config.json not found"),
        (LoRARequest("big", 3, str(adapters["mlp16"])), "rank 16, above max_lora_rank 8"),
        (LoRARequest("embed", 4, str(embed)), "target module model.embed_tokens is not supported"),
    ]
    for request, message in cases:
        with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
            llm.add_request(prompt, params, lora_request=request)
    assert not llm.has_unfinished_requests()
    llm.generate([prompt], params, lora_request=LoRARequest("qv4", 5, str(adapters["qv4"])))
    with pytest.raises(ModelError, match="adapter 'qv4' is already loaded from"):
        llm.add_request(prompt, params, lora_request=LoRARequest("qv4", 5, str(adapters["all8"])))
    with pytest.raises(ValueError, match="set enable_lora=True"):
        LLM(str(llama_dir)).add_request(prompt, params, lora_request=LoRARequest("qv4", 1, str(adapters["qv4"])))


def test_triton_kernels_in_the_engine(llama_dir, adapters, mixed, monkeypatch):
    """The Triton shrink/expand pair (under TRITON_INTERPRET=1 without a GPU) on zero-padded adapter stacks."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases, expected = mixed
    got, llm = run(llama_dir, adapters, cases[:8], linear_backend="triton", max_num_batched_tokens=32)
    assert got == expected[:8]
    assert llm.runner.lora.layers["model.layers.0.self_attn.qkv_proj"].stack_a is not None


ARCH_TARGETS = {  # the projections PEFT names in each family (Phi-3 fuses q/k/v and gate/up; MoE experts are not
    # Linear projections, so their adapters target attention)
    "mistral": ADAPTERS, "qwen2": ADAPTERS, "qwen3": ADAPTERS, "gemma2": ADAPTERS, "gemma3": ADAPTERS,
    "phi3": {"qkv4": (4, 8, ("qkv_proj",), False), "all8": (8, 16, ("qkv_proj", "o_proj", "gate_up_proj",
                                                                      "down_proj"), False),
             "mlp16": (16, 32, ("gate_up_proj", "down_proj"), True)},
    "mixtral": {"qv4": (4, 8, ("q_proj", "v_proj"), False), "attn8": (8, 16, ("q_proj", "k_proj", "v_proj",
                                                                              "o_proj"), False),
                "o16": (16, 32, ("o_proj",), True)},
}


@pytest.mark.parametrize("arch", ARCH_TARGETS)
def test_every_architecture_with_mixed_adapters(checkpoints, arch, tmp_path):
    path = checkpoints(arch)
    specs = ARCH_TARGETS[arch]
    built = {name: build_lora_adapter(path, tmp_path / name, rank=r, alpha=alpha, targets=targets, seed=i + 1,
                                      use_rslora=rs) for i, (name, (r, alpha, targets, rs)) in enumerate(specs.items())}
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    names = [None, *specs]
    cases = [(p, names[i % len(names)]) for i, p in enumerate(make_prompts(vocab, seed=5)[:8])]
    eager = {"attn_implementation": "eager"} if arch.startswith("gemma") else {}
    expected = peft_greedy(path, built, cases, **eager)
    got, _ = run(path, built, cases, max_num_batched_tokens=32)
    assert got == expected
    assert len({json.dumps([t for t, (_, n) in zip(got, cases) if n == name]) for name in names}) == len(names)
