"""Many LoRA adapters in one batch: the bench workload spread over 8 adapters of rank 16 against the same requests on
the base model alone, in one run.

Prints output tokens/s of the base model on a plain engine, of the base model on the LoRA engine (what serving
adapters costs requests that use none), and of the requests spread over the adapters (issue #40's target: at least
0.8 of the base model's throughput on CPU), and the device memory each adapter's slot takes. Greedy with ignore_eos,
so every variant computes the same number of tokens. Each variant runs --repeat times, interleaved; the fastest run
counts. Needs `peft` to write the adapters (once, under the cache directory).
Run: python bench/lora.py [--requests 64] [--adapters 8] [--rank 16] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, workload  # noqa: E402

from sluice.worker.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from sluice.worker.engine.demo import build_lora_adapter, cache_dir  # noqa: E402


def adapters(base: Path, count: int, rank: int) -> list[LoRARequest]:
    out = []
    for i in range(count):
        path = cache_dir() / f"bench-lora-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            build_lora_adapter(base, path, rank=rank, alpha=2 * rank, seed=i)
        out.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return out


def run(llm: LLM, reqs, loras) -> float:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    llm.generate([r.prompt for r in reqs], params, lora_request=loras)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    base = bench_model()
    loras = adapters(base, args.adapters, args.rank)
    reqs = workload(args.requests)
    spread = [loras[i % len(loras)] for i in range(len(reqs))]
    plain = LLM(str(base), max_num_seqs=64, enable_prefix_caching=False)
    served = LLM(str(base), max_num_seqs=64, enable_prefix_caching=False, enable_lora=True,
                 max_loras=args.adapters, max_lora_rank=args.rank)
    variants = {"base, plain engine": (plain, None), "base, LoRA engine": (served, None),
                f"{args.adapters} adapters": (served, spread)}
    for llm, lora in variants.values():  # warm up, and read every adapter into its slot
        run(llm, reqs[:len(loras)], lora if lora is None else lora[:len(loras)])
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeat):
        for name, (llm, lora) in variants.items():
            best[name] = min(best[name], run(llm, reqs, lora))
    tokens = sum(r.max_tokens for r in reqs)
    for name, seconds in best.items():
        print(f"{name:20s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    base_s = best["base, plain engine"]
    print(f"ratios to the base model on a plain engine: LoRA engine, base requests "
          f"{base_s / best['base, LoRA engine']:.3f}; spread over {args.adapters} adapters "
          f"{base_s / best[f'{args.adapters} adapters']:.3f}")
    manager = served.runner.lora
    per = [a.nbytes for a in manager.adapters.values()]
    print(f"adapter memory: {sum(per) / len(per) / 2**20:.2f} MiB each (rank {args.rank}, every projection of "
          f"{served.model_config.num_layers} layers), weights {served.runner.weight_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
