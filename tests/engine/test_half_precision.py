"""The bfloat16 and float16 engine on the CPU through its decode path (the C++ element-wise kernels and paged decode
attention reading the half-precision cache) against transformers' forward in the same dtype."""

from __future__ import annotations

import pytest
import torch
import transformers

from sluice.kernels import cpu_attention, cpu_layers
from sluice.worker.engine import LLM, SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generated_tokens_are_transformers_argmax_teacher_forced(llama_dir, monkeypatch, dtype):
    """Each token the engine generates (greedy, 24 decode steps a prompt, 12 prompts batched) is transformers'
    argmax at that position given the same tokens before it, at 95% of positions or more; the decode steps ran
    through the C++ kernels."""
    torch_dtype = getattr(torch, dtype)
    if torch_dtype not in cpu_layers.dtypes() or torch_dtype not in cpu_attention.dtypes():
        pytest.skip(f"kernels built without {dtype}")
    calls = {"decode": 0}
    decode = cpu_attention.paged_decode_attention_cpu

    def counted(q, *args, **kwargs):
        assert q.dtype == torch_dtype
        calls["decode"] += 1
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention_cpu", counted)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch_dtype)
    llm = LLM(str(llama_dir), dtype=dtype)
    prompts = [[5 + (i * 13 + j * 7) % 400 for j in range(10 + 3 * i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert calls["decode"] > 0
    agree = total = 0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
        agree += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), out.token_ids))
        total += len(out.token_ids)
    assert total == 12 * 24 and agree >= 0.95 * total, (agree, total)
