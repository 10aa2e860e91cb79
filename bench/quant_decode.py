"""Decode throughput of the bench Llama in fp32, bf16, INT8 and INT4 weights, at batch 1 and batch 32, one run.

Decode reads every weight once per step, so at small batch its speed follows the bytes of the weights.
Run: python bench/quant_decode.py [--steps 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# common first: it imports sluice, which sets OpenMP's spin before torch loads
# isort: off
from common import bench_model  # noqa: E402
import torch  # noqa: E402
# isort: on

from sluice.worker.engine import LLM, SamplingParams  # noqa: E402

CONFIGS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8 (fp32 model)": dict(dtype="float32", quantization="int8"),
    "int4 g128 (fp32 model)": dict(dtype="float32", quantization="int4"),
    "int8 (bf16 model)": dict(dtype="bfloat16", quantization="int8"),
    "int4 g128 (bf16 model)": dict(dtype="bfloat16", quantization="int4"),
    "int4 + lm_head (bf16)": dict(dtype="bfloat16", quantization="int4", quantize_lm_head=True),
}


def decode_rate(llm: LLM, batch: int, steps: int) -> float:
    """Output tokens/s over `steps` pure decode steps of `batch` sequences (prefill excluded)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        llm.add_request([5 + (i * 7 + j) % 4000 for j in range(32)], params, f"d{batch}-{i}")
    while any(s.num_remaining > 1 for s in llm.scheduler.running) or llm.scheduler.num_waiting:
        llm.step()
    for _ in range(3):  # warm up the decode shapes
        llm.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    rate = batch * steps / (time.perf_counter() - start)
    while llm.has_unfinished_requests():
        llm.step()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    path = bench_model()
    rows = []
    for name, kwargs in CONFIGS.items():
        llm = LLM(str(path), max_num_seqs=32, num_kv_blocks=512, **kwargs)
        weight_bytes = llm.stats()["weight_bytes"]
        rows.append((name, weight_bytes, decode_rate(llm, 1, args.steps), decode_rate(llm, 32, args.steps)))
        del llm
    base = rows[0]
    bf16_bytes = rows[1][1]
    print(f"bench Llama (91M-class), decode tokens/s, {torch.get_num_threads()} threads; ratios against fp32")
    print(f"{'weights':24s} {'MiB':>7s} {'vs bf16':>8s} {'batch 1':>9s} {'ratio':>6s} {'batch 32':>9s} {'ratio':>6s}")
    for name, nbytes, r1, r32 in rows:
        print(f"{name:24s} {nbytes / 2**20:7.1f} {nbytes / bf16_bytes:7.0%} {r1:9.1f} {r1 / base[2]:5.2f}x "
              f"{r32:9.1f} {r32 / base[3]:5.2f}x")


if __name__ == "__main__":
    main()
