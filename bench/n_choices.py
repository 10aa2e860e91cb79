"""n=4 against four separate requests: the prompt's prefill computed once and shared, or once per request.

Each of --requests prompts (long: 300-800 tokens, where sharing matters) asks for 4 sampled completions, either as
one request with n=4 or as four n=1 requests with seeds seed+0..3, which are the seeds the n=4 choices use: both runs
generate the same tokens (checked). Prints the prefill tokens each computed, output tokens/s and their ratios. Prefix
caching is on in both (the default), and the scheduler makes a request wait for prompt blocks a running one is
computing, so four requests arriving together also compute the prompt about once: what n=4 saves beyond that is the
scheduling of four requests. Each variant runs --repeat times, interleaved; the fastest run counts.
Run: python bench/n_choices.py [--requests 16] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, workload  # noqa: E402

from sluice.worker.engine import LLM, SamplingParams  # noqa: E402

N = 4


def params(max_tokens: int, seed: int, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=50, seed=seed, ignore_eos=True, n=n)


def run(llm: LLM, reqs, together: bool) -> tuple[float, int, list[list[int]]]:
    """Seconds, prefill tokens computed, and every completion's tokens in (prompt, choice) order."""
    llm.reset_prefix_cache()
    before = llm.stats()["num_prefill_tokens"]
    if together:
        prompts, plist = [r.prompt for r in reqs], [params(r.max_tokens, 100 * i, N) for i, r in enumerate(reqs)]
    else:
        prompts = [r.prompt for r in reqs for _ in range(N)]
        plist = [params(r.max_tokens, 100 * i + c, 1) for i, r in enumerate(reqs) for c in range(N)]
    start = time.perf_counter()
    outs = llm.generate(prompts, plist)
    seconds = time.perf_counter() - start
    tokens = [c.token_ids for o in outs for c in o.choices] if together else [o.token_ids for o in outs]
    return seconds, llm.stats()["num_prefill_tokens"] - before, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(str(bench_model()), max_num_seqs=64)
    reqs = workload(args.requests, prompt_range=(300, 800), max_tokens_range=(16, 64))
    run(llm, reqs[:2], True)  # warm up
    best: dict[bool, tuple[float, int, list[list[int]]]] = {}
    for _ in range(args.repeat):
        for together in (True, False):
            result = run(llm, reqs, together)
            if together not in best or result[0] < best[together][0]:
                best[together] = result
    (n_s, n_prefill, n_tokens), (sep_s, sep_prefill, sep_tokens) = best[True], best[False]
    assert n_tokens == sep_tokens, "choice i must equal the lone request seeded seed + i"
    out = sum(map(len, n_tokens))
    print(f"{args.requests} prompts x {N} completions, {out} output tokens each way")
    print(f"n={N}:            prefill {n_prefill} tokens, {n_s:.2f} s = {out / n_s:.1f} tok/s")
    print(f"{N} requests each: prefill {sep_prefill} tokens, {sep_s:.2f} s = {out / sep_s:.1f} tok/s")
    print(f"ratios (n={N} / separate): prefill tokens {n_prefill / sep_prefill:.3f}, throughput {sep_s / n_s:.2f}x")


if __name__ == "__main__":
    main()
