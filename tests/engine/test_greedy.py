"""Greedy tokens of the engine equal transformers' own generate, under every scheduling regime."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.linear import can_pack_mkl

NUM_PROMPTS = 32


def make_prompts(vocab: int, seed: int, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(shared_prefix)]
    prompts = []
    for i in range(NUM_PROMPTS):
        length = 1 + (i * 37) % 90 if not shared_prefix else rng.randrange(1, 30)
        prompts.append((prefix + [rng.randrange(5, vocab) for _ in range(length)], rng.randrange(4, 24)))
    return prompts


def hf_greedy(path, prompts, attn_implementation: str | None = None) -> list[list[int]]:
    """transformers' greedy tokens; attn_implementation="eager" where its SDPA path would drop a score soft-cap."""
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **options)
    eos = model.config.eos_token_id
    outs = []
    for ids, max_new in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def run_engine(path, prompts, **engine_kwargs):
    llm = LLM(str(path), **engine_kwargs)
    planned = []
    schedule = llm.scheduler.schedule

    def spy():
        plan = schedule()
        planned.append([(seq.request_id, n) for seq, n in plan.scheduled])
        return plan

    llm.scheduler.schedule = spy
    params = [SamplingParams(max_tokens=m, temperature=0) for _, m in prompts]
    outs = llm.generate([ids for ids, _ in prompts], params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
    return [o.token_ids for o in outs], stats, planned


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def arch_case(request, checkpoints):
    path = checkpoints(request.param)
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = make_prompts(vocab, seed=hash(request.param) % 1000)
    return path, prompts, hf_greedy(path, prompts)


@pytest.mark.parametrize("cpu_gemm", ["auto", "mkl", "onednn"])
def test_ample_cache(arch_case, cpu_gemm):
    """Whichever packed float32 GEMM multiplies the projections on a CPU (on CUDA the choice is unused)."""
    if cpu_gemm == "mkl" and not can_pack_mkl(torch.empty(1)):
        pytest.skip("PyTorch built without MKL")
    path, prompts, expected = arch_case
    got, stats, planned = run_engine(path, prompts, cpu_gemm=cpu_gemm)
    assert got == expected
    assert stats["num_preemptions"] == 0
    assert max(len(step) for step in planned) > 1, "requests were not batched"


@pytest.mark.parametrize("budget", [0, None], ids=["buckets-of-8", "byte-budget"])
def test_decode_buckets(arch_case, monkeypatch, budget):
    """Decode rows attended in buckets of DECODE_BUCKET and in byte-budget buckets give the same tokens (the C++
    kernel, which otherwise takes them, unavailable as where it cannot be built)."""
    from sluice.worker.engine import attention

    monkeypatch.setattr(attention.cpu_attention, "available", lambda: False)
    if budget is not None:
        monkeypatch.setattr(attention, "BUCKET_BYTES", budget)
    sizes = []
    ends_of = attention.bucket_ends

    def spy(*args):
        ends = ends_of(*args)
        sizes.extend(b - a for a, b in zip([0, *ends], ends))
        return ends

    monkeypatch.setattr(attention, "bucket_ends", spy)
    path, prompts, expected = arch_case
    got, _, _ = run_engine(path, prompts)
    assert got == expected
    if budget == 0:
        assert max(sizes) == attention.DECODE_BUCKET
    else:  # the tiny models' short contexts fit all of a step's decode rows in one bucket
        assert max(sizes) > attention.DECODE_BUCKET


def test_preemption_keeps_outputs(arch_case):
    path, prompts, expected = arch_case
    got, stats, _ = run_engine(path, prompts, num_kv_blocks=16)
    assert stats["num_preemptions"] > 0
    assert got == expected


def test_chunked_prefill(arch_case):
    path, prompts, expected = arch_case
    budget = 16
    got, stats, planned = run_engine(path, prompts, max_num_batched_tokens=budget)
    assert got == expected
    assert all(sum(n for _, n in step) <= budget for step in planned)
    chunks: dict[str, int] = {}
    for step in planned:
        for rid, n in step:
            if n > 1:
                chunks[rid] = chunks.get(rid, 0) + 1
    assert max(chunks.values()) > 1, "no prompt was prefilled over several steps"


def test_prefill_first_policy(arch_case):
    path, prompts, expected = arch_case
    got, _, _ = run_engine(path, prompts, scheduling_policy="prefill_first", max_num_batched_tokens=64)
    assert got == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_hits_cache(checkpoints, arch):
    path = checkpoints(arch)
    vocab = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    prompts = make_prompts(vocab, seed=7, shared_prefix=70)
    expected = hf_greedy(path, prompts)
    got, stats, _ = run_engine(path, prompts, max_num_seqs=8)
    assert stats["prefix_cache_hits"] >= (NUM_PROMPTS - 8) * 64
    assert got == expected


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_sliding_window_matches_transformers(checkpoints, engine_kwargs):
    """Mistral's sliding window, in decode and in prefill (whole prompts, and chunks that start past the window)."""
    path = checkpoints("mistral_window")
    assert transformers.AutoConfig.from_pretrained(str(path)).sliding_window == 16
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(str(path)).vocab_size, seed=7)
    assert max(len(ids) for ids, _ in prompts) > 16
    got, _, _ = run_engine(path, prompts, **engine_kwargs)
    assert got == hf_greedy(path, prompts)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_qwen2_max_window_layers_matches_transformers(tmp_path, tokenizer_dir, engine_kwargs):
    """Qwen2 slides only the layers from max_window_layers on: here layer 0 attends in full, layer 1 in a window."""
    from sluice.worker.engine.demo import build_checkpoint

    path = build_checkpoint(tmp_path, "Qwen2ForCausalLM", seed=3, tokenizer_dir=tokenizer_dir, use_sliding_window=True,
                            sliding_window=8, max_window_layers=1, num_hidden_layers=2, initializer_range=0.1)
    assert transformers.AutoConfig.from_pretrained(str(path)).layer_types == ["full_attention", "sliding_attention"]
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(str(path)).vocab_size, seed=8)[:12]
    got, _, _ = run_engine(path, prompts, **engine_kwargs)
    assert got == hf_greedy(path, prompts)


def test_colliding_prefixes_share_no_kv(tmp_path, tokenizer_dir):
    """Blocks whose token tuples collide in Python's hash(): a prompt must not be served the K/V of a block that was
    computed after the other one (a request could poison another's prefix)."""
    from sluice.worker.engine.demo import build_checkpoint

    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=1, tokenizer_dir=tokenizer_dir, vocab_size=65536)
    a, b = [14571, 58961, 60645, 8234], [36695, 53933, 28465, 0]  # as in test_block_manager.COLLIDING
    first, attacker, victim = [*a, 7], [*b, 101, 202, 303, 404, 9], [*a, 101, 202, 303, 404, 11]
    llm = LLM(str(path), block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)  # ids past the tokenizer
    for prompt in (first, attacker):
        llm.generate(prompt, params)
    out = llm.generate(victim, params)[0]
    assert out.token_ids == hf_greedy(path, [(victim, 4)])[0]
    assert out.num_cached_tokens == 4  # the first block, which is a's


def test_a_llama_configs_sliding_window_is_ignored_as_transformers_does(tmp_path, tokenizer_dir):
    """Llamafied checkpoints may keep a sliding_window key; transformers' Llama attends in full regardless. Its
    generate() is no reference here (its cache slides while its prefill does not), so the reference is argmax of
    whole forwards without a cache."""
    from sluice.worker.engine.demo import build_checkpoint

    path = build_checkpoint(tmp_path, "LlamaForCausalLM", seed=3, tokenizer_dir=tokenizer_dir, sliding_window=8,
                            initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert model.config.sliding_window == 8
    prompt = list(range(5, 35))
    want = list(prompt)
    for _ in range(8):
        with torch.no_grad():
            want.append(int(model(torch.tensor([want]), use_cache=False).logits[0, -1].argmax()))
    out = LLM(str(path)).generate([prompt], [SamplingParams(max_tokens=8, temperature=0)])[0]
    assert out.token_ids == want[len(prompt):]
