"""Quality of INT8/INT4 weights: relative error of the logits and top-1 agreement against the float model.

Teacher-forced on real text: every prompt position's logits from the quantized engine are compared with the
float engine's on the same input. Run: python bench/quant_quality.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# common first: it imports sluice, which sets OpenMP's spin before torch loads
# isort: off
from common import bench_model  # noqa: E402
import torch  # noqa: E402
# isort: on

from sluice.worker.engine import LLM  # noqa: E402
from sluice.worker.engine.demo import _corpus, build_checkpoint  # noqa: E402

TEST_MODELS = {  # the shapes tests/conftest.py builds
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


def prompts(n: int = 8) -> list[str]:
    lines = [line.strip() for doc in _corpus()[:6] for line in doc.splitlines() if len(line.strip()) > 30]
    return [" ".join(lines[i * 3:(i + 1) * 3]) for i in range(n)]


def compare(path: Path, texts: list[str], **quant) -> tuple[float, float]:
    """(relative Frobenius error of the logits, top-1 agreement) of a quantized engine vs the float one."""
    ref, test = LLM(str(path)), LLM(str(path), **quant)
    num = den = agree = total = 0.0
    for text in texts:
        a, b = ref.prompt_logits(text), test.prompt_logits(text)
        num += (b - a).pow(2).sum().item()
        den += a.pow(2).sum().item()
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
    return (num / den) ** 0.5, agree / total


def modes(groups: tuple[int, ...]) -> list[dict]:
    return [dict(quantization="int8")] + [dict(quantization="int4", quantization_group_size=g) for g in groups]


def main() -> None:
    texts = prompts()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, overrides) in TEST_MODELS.items():
            path = build_checkpoint(Path(tmp) / name, arch, seed=1, **overrides)
            # intermediate 160: only group 32 divides it
            rows += [(f"test {name} (hidden 64)", q, *compare(path, texts, **q)) for q in modes((32,))]
    bench = bench_model()
    rows += [("bench llama 91M (hidden 1024)", q, *compare(bench, texts, **q))
             for q in modes((128, 32))]
    print(f"{len(texts)} prompts of real text, teacher-forced; float32 reference")
    print(f"{'model':32s} {'quantization':18s} {'logits rel err':>15s} {'top-1 agreement':>16s}")
    for model, q, err, agree in rows:
        label = q["quantization"] + (f" g{q['quantization_group_size']}" if "quantization_group_size" in q else "")
        print(f"{model:32s} {label:18s} {err:15.4f} {agree:16.3f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
