"""Continuous batching vs static batching (same engine) vs transformers' padded static batches, one workload.

Prints useful output tokens/s of each and the ratios, and the KV memory the workload needs from the paged cache
versus contiguous preallocation. Each engine runs --repeat times, interleaved, and its fastest run counts: this
machine's speed drifts by tens of percent over seconds, and the fastest run is the least disturbed one. The prefix
cache is emptied before every run, so no run reuses another's prompts.
Run: python bench/throughput.py [--requests 64] [--batch 16] [--repeat 2] [--skip-hf] [--cpu-gemm mkl|onednn]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# common first: it imports sluice, which sets OpenMP's spin before torch loads
# isort: off
from common import bench_model, workload  # noqa: E402
import torch  # noqa: E402
# isort: on

from sluice.worker.engine import LLM, SamplingParams  # noqa: E402
from sluice.worker.engine.config import CPU_GEMMS  # noqa: E402
from sluice.worker.engine.linear import PACKED_FLOAT32, Linear, can_pack_float32, can_pack_mkl, cpu_gemm  # noqa: E402

OTHER_BLOCKS = (8, 32)


def params(req) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)


def run_continuous(llm: LLM, reqs) -> tuple[float, dict]:
    """All requests submitted at once; returns seconds and KV occupancy samples taken every step."""
    for i, r in enumerate(reqs):
        llm.add_request(r.prompt, params(r), f"c{i}")
    start = time.perf_counter()
    kv = {"peak_blocks": 0, "slot_sum": 0, "token_sum": 0, "slots_by_block_size": dict.fromkeys(OTHER_BLOCKS, 0)}
    while llm.has_unfinished_requests():
        llm.step()
        running = llm.scheduler.running
        used = llm.block_manager.num_used_blocks
        kv["peak_blocks"] = max(kv["peak_blocks"], used)
        kv["slot_sum"] += used * llm.block_manager.block_size
        kv["token_sum"] += sum(s.num_computed_tokens for s in running)
        for bs in OTHER_BLOCKS:  # what the same sequences would hold with other block sizes
            kv["slots_by_block_size"][bs] += sum(-(-s.num_computed_tokens // bs) * bs for s in running)
    return time.perf_counter() - start, kv


def run_static(llm: LLM, reqs, batch: int) -> float:
    """The same engine, but a batch of `batch` runs until its longest member finishes before the next joins."""
    start = time.perf_counter()
    for b in range(0, len(reqs), batch):
        for i, r in enumerate(reqs[b:b + batch]):
            llm.add_request(r.prompt, params(r), f"s{b + i}")
        while llm.has_unfinished_requests():
            llm.step()
    return time.perf_counter() - start


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def run_hf(model, reqs, batch: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(reqs), batch):
        group = reqs[b:b + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in group])  # left padding
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in group),
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cpu-gemm", default="auto", choices=CPU_GEMMS, help="the engine's float32 CPU GEMM")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = bench_model()
    reqs = workload(args.requests)
    useful = sum(r.max_tokens for r in reqs)
    llm = LLM(str(path), max_num_seqs=args.requests, max_num_batched_tokens=2048, cpu_gemm=args.cpu_gemm)
    llm.generate([reqs[0].prompt], params(reqs[0]))  # warm up
    print(f"workload: {len(reqs)} requests, prompts {min(len(r.prompt) for r in reqs)}-"
          f"{max(len(r.prompt) for r in reqs)} tokens, max_tokens {min(r.max_tokens for r in reqs)}-"
          f"{max(r.max_tokens for r in reqs)}, {useful} useful output tokens; {torch.get_num_threads()} threads")
    kv: dict = {}

    def continuous() -> float:
        seconds, occupancy = run_continuous(llm, reqs)
        kv.update(occupancy)
        return seconds

    runs = {"sluice continuous batching": continuous,
            f"sluice static batches of {args.batch}": lambda: run_static(llm, reqs, args.batch)}
    if not args.skip_hf:
        hf = hf_model(path)
        runs[f"transformers generate, static {args.batch}, padded"] = lambda: run_hf(hf, reqs, args.batch)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, run in runs.items():
            llm.reset_prefix_cache()
            times[name].append(run())
    rows = [(name, min(t)) for name, t in times.items()]
    base = rows[-1][1]
    print(f"{'engine':45s} {'seconds':>8s} {'tok/s':>8s} {'vs last':>8s}  all runs (s)")
    for name, t in rows:
        print(f"{name:45s} {t:8.1f} {useful / t:8.1f} {base / t:7.2f}x  {' '.join(f'{x:.1f}' for x in times[name])}")
    if args.repeat > 1:  # each round's engines ran back to back: the same spell of the machine
        first, last = times[rows[0][0]], times[rows[-1][0]]
        print("first row vs last, round by round: " + " ".join(f"{b / a:.2f}x" for a, b in zip(first, last)))
    print_roofline(llm, reqs, useful, base)
    print_kv(llm, reqs, kv, args.batch)


def gemm_rate(matmul, rows: int = 2048) -> float:
    """FLOP/s of `matmul` on [rows, 1024] x this model's MLP weight [2816, 1024], measured now."""
    a = torch.randn(rows, 1024)
    for _ in range(3):
        matmul(a)
    start = time.perf_counter()
    for _ in range(10):
        matmul(a)
    return 10 * 2 * rows * 1024 * 2816 / (time.perf_counter() - start)


def matmul_peak() -> dict[str, float]:
    """The machine's compute ceiling: a large GEMM through PyTorch's matmul (MKL, unpacked) and through the engine's
    packed layers, oneDNN's and MKL's (which is faster depends on the CPU: the fastest is the real ceiling)."""
    w = torch.randn(2816, 1024)
    rates = {"torch matmul": gemm_rate(lambda a: a @ w.T)}
    for name, usable in (("onednn", can_pack_float32(w)), ("mkl", can_pack_mkl(w))):
        if usable:
            layer = Linear(1024, [2816])
            layer.weight.data.copy_(w)
            layer.method = PACKED_FLOAT32[name](layer)
            rates[f"packed {name}"] = gemm_rate(layer)
    return rates


def print_roofline(llm: LLM, reqs, useful: int, baseline_seconds: float) -> None:
    """Every prompt token and every output token costs 2 FLOPs per matmul weight: the least work possible."""
    c = llm.model_config
    layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    layer += 3 * c.hidden_size * c.intermediate_size
    per_token = 2 * c.num_layers * layer
    flops = per_token * sum(len(r.prompt) + r.max_tokens for r in reqs) + 2 * c.hidden_size * c.vocab_size * useful
    rates = matmul_peak()
    peak = max(rates.values())
    ceiling = useful / (flops / peak)
    print(f"compute ceiling: {flops / 1e12:.2f} TFLOP of matmuls at the measured fp32 GEMM peak of {peak / 1e9:.0f} "
          f"GFLOP/s ({', '.join(f'{k} {v / 1e9:.0f}' for k, v in rates.items())}; the engine's: packed "
          f"{cpu_gemm(llm.config.cpu_gemm)}) = {ceiling:.0f} tok/s at most "
          f"({ceiling * baseline_seconds / useful:.2f}x the last row)")


def print_kv(llm: LLM, reqs, kv: dict, batch: int) -> None:
    per_token = llm.runner.bytes_per_block() // llm.block_manager.block_size
    mib = lambda tokens: tokens * per_token / 2**20
    paged_waste = 1 - kv["token_sum"] / kv["slot_sum"]
    # contiguous preallocation as padded static batching does it: every row sized to the batch's longest
    # prompt plus its largest max_tokens; the waste is what never holds a token
    reserved = needed = 0
    for b in range(0, len(reqs), batch):
        group = reqs[b:b + batch]
        reserved += len(group) * (max(len(r.prompt) for r in group) + max(r.max_tokens for r in group))
        needed += sum(len(r.prompt) + r.max_tokens for r in group)
    print(f"KV memory, {per_token} bytes per token:")
    print(f"  paged cache pool reserved: {mib(llm.block_manager.num_blocks * llm.block_manager.block_size):8.1f} MiB;"
          f" peak used: {mib(kv['peak_blocks'] * llm.block_manager.block_size):.1f} MiB;"
          f" waste inside used blocks (mean over steps): {paged_waste:.1%}; with {OTHER_BLOCKS[0]}-token blocks "
          f"{1 - kv['token_sum'] / kv['slots_by_block_size'][OTHER_BLOCKS[0]]:.1%}, with {OTHER_BLOCKS[1]}: "
          f"{1 - kv['token_sum'] / kv['slots_by_block_size'][OTHER_BLOCKS[1]]:.1%}")
    print(f"  contiguous preallocation (static {batch}, rows padded to longest prompt + max_tokens): "
          f"waste {1 - needed / reserved:.1%}")
    print(f"  contiguous preallocation to max_model_len ({llm.max_model_len}) for {batch} sequences: "
          f"{mib(batch * llm.max_model_len):.1f} MiB per batch; waste "
          f"{1 - needed / (len(reqs) * llm.max_model_len):.1%}")


if __name__ == "__main__":
    main()
