"""Structured outputs' cost: the bench Llama workload with every line under one json_schema against the same lines
unconstrained, in the same run.

Prints output tokens/s of each and their ratio (issue #38's target: constrained at least 85% of unconstrained at 64
running sequences), the grammar's compile time (once for the whole batch: cached by schema) and the bitmask time per
step (filling the masks of every constrained row, and applying them). Random weights close some JSON early, so each
unconstrained line runs to the length its constrained twin reached (ignore_eos): both runs compute the same tokens.
Each variant runs --repeat times, interleaved; the fastest run counts.
Run: python bench/structured.py [--requests 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_model, workload  # noqa: E402

from sluice.worker.engine import LLM, SamplingParams  # noqa: E402
from sluice.worker.engine.grammar import GrammarStats  # noqa: E402
from sluice.worker.engine.structured_outputs import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
    "required": ["label", "score", "keywords"], "additionalProperties": False}


def run(llm: LLM, reqs, lengths: list[int] | None) -> tuple[float, list[int], GrammarStats]:
    """Constrained where lengths is None, else unconstrained to those lengths; seconds, lengths, grammar stats."""
    llm.grammars.stats = GrammarStats()
    llm.grammars.clear_cache()
    if lengths is None:
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)) for r in reqs]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    return time.perf_counter() - start, [len(o.token_ids) for o in outs], llm.grammars.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(str(bench_model()), max_num_seqs=64)
    reqs = workload(args.requests)
    run(llm, reqs[:4], None)  # warm up: kernels, the tokenizer's xgrammar info
    best: dict[bool, tuple[float, list[int], GrammarStats]] = {}
    lengths = None
    for _ in range(args.repeat):
        for constrained in (True, False):
            seconds, lengths, stats = run(llm, reqs, None if constrained else lengths)
            if constrained not in best or seconds < best[constrained][0]:
                best[constrained] = (seconds, lengths, stats)
            llm.reset_prefix_cache()
    (free_s, free_lengths, _), (json_s, json_lengths, stats) = best[False], best[True]
    assert free_lengths == json_lengths
    free_tokens = json_tokens = sum(json_lengths)
    print(f"unconstrained: {free_tokens} tokens in {free_s:.2f} s = {free_tokens / free_s:.1f} tok/s")
    print(f"json_schema:   {json_tokens} tokens in {json_s:.2f} s = {json_tokens / json_s:.1f} tok/s")
    print(f"ratio (constrained / unconstrained tok/s): {json_tokens / json_s / (free_tokens / free_s):.3f}")
    print(f"grammar compile: {stats.compiles} compile(s), {stats.compile_seconds * 1e3:.1f} ms")
    print(f"mask time: {stats.mask_seconds / max(stats.mask_steps, 1) * 1e3:.3f} ms per step over "
          f"{stats.mask_steps} steps ({stats.mask_seconds / json_s:.1%} of the constrained run)")


if __name__ == "__main__":
    main()
