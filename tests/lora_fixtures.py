"""LoRA adapters for the service tests: two random PEFT adapters of the tiny Llama in one --lora-dir, and what the
engine itself generates with each (the reference every service path must equal)."""

from __future__ import annotations

import pytest

from sluice.worker.engine import LLM, LoRARequest, SamplingParams
from sluice.worker.engine.demo import build_lora_adapter

ADAPTERS = {"a": dict(rank=8, alpha=16, seed=1), "b": dict(rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2)}
PROMPTS = ["The zen of", "Beautiful is better than", "Simple is better than complex"]
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def lora_dir(llama_dir, tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("loras")
    for name, options in ADAPTERS.items():
        build_lora_adapter(llama_dir, root / name, **options)
    return root


def completion_line(custom_id: str, model: str | None, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **({"model": model} if model else {})}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def mixed_lines(base: str, unnamed: bool = False) -> list[dict]:
    """Every prompt under the base model (by name, and with `unnamed` by naming none: `sluice run` only, the API
    needs a model) and under each adapter, interleaved."""
    lines = []
    for i, prompt in enumerate(PROMPTS):
        for model in (base, *([None] if unnamed else []), *ADAPTERS):
            lines.append(completion_line(f"{model or 'none'}-{i}", model, prompt))
    return lines


def engine_texts(llama_dir, lora_dir, lines: list[dict], base: str) -> dict[str, str]:
    """What the engine gives each line alone, greedy, with its adapter."""
    llm = LLM(str(llama_dir), enable_lora=True)
    loras = {name: LoRARequest(name, i, str(lora_dir / name)) for i, name in enumerate(ADAPTERS, 1)}
    texts = {}
    for line in lines:
        model = line["body"].get("model")
        out = llm.generate(line["body"]["prompt"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           lora_request=None if model in (None, base) else loras[model])[0]
        texts[line["custom_id"]] = out.text
    return texts


def check_mixed(texts: dict[str, str], expected: dict[str, str], base: str) -> None:
    """Every line as the engine gives it alone, and the adapters' outputs differ from each other and the base's."""
    assert texts == expected
    for i in range(len(PROMPTS)):
        assert len({texts[f"{base}-{i}"], texts[f"a-{i}"], texts[f"b-{i}"]}) == 3, i
        assert texts.get(f"none-{i}", texts[f"{base}-{i}"]) == texts[f"{base}-{i}"]
