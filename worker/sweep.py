"""A batch-size sweep: one workload through one engine at each max_num_seqs cap, summarised per cap, with the knee
(the smallest cap within 5% of the best throughput)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sluice.api.batch_lines import BatchRequest, BatchValidator, LineError
from sluice.worker.adapters import ServedModels, UnknownModel
from sluice.worker.engine import LLMEngine, LoRARequest, RequestOutput, RequestRejected, SamplingParams
from sluice.worker.translate import PromptError, engine_inputs

KNEE_FRACTION = 0.95  # within 5% of the best throughput
WARMUP_REQUESTS = 4  # run before the first cap, so it does not pay for kernels' first calls


@dataclass
class Workload:
    """Requests as the engine takes them: prompt token ids and sampling parameters (and an adapter, or None)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    loras: list[LoRARequest | None] = field(default_factory=list)
    skipped: int = 0  # input lines that would not run

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class SweepRow:
    max_num_seqs: int
    num_requests: int
    failed: int  # refused by the engine
    seconds: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    latency_p50_s: float
    latency_p95_s: float
    mean_kv_use: float  # of the cache's blocks, weighted by step time
    num_preemptions: int
    knee: bool = False


def synthetic_workload(num_requests: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                       vocab_size: int, seed: int) -> Workload:
    """Random prompts and output lengths drawn uniformly from the ranges; each request generates exactly its length
    (eos ignored) and builds no text."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_tokens))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(*output_tokens), ignore_eos=True, detokenize=False)
              for _ in range(num_requests)]
    return Workload(prompts, params, [None] * num_requests)


def file_workload(path: Path, engine: LLMEngine, served: ServedModels) -> Workload:
    """A batch file's lines as `sluice run` would submit them; lines that would not run are counted and left out."""
    workload = Workload([], [])
    validator = BatchValidator()
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            request = validator.validate(raw, number)
            submission = None if isinstance(request, LineError) else _submission(request, engine, served)
            if submission is None:
                workload.skipped += 1
                continue
            for items, item in zip((workload.prompts, workload.params, workload.loras), submission):
                items.append(item)
    return workload


def _submission(request: BatchRequest, engine: LLMEngine,
                served: ServedModels) -> tuple[list[int], SamplingParams, LoRARequest | None] | None:
    try:
        _, lora = served.resolve(request.body.model if served.loras else None)
        token_ids, params = engine_inputs(engine.processor, request.url, request.body)
    except (PromptError, UnknownModel):
        return None
    return token_ids, params, lora


def run_sweep(engine: LLMEngine, workload: Workload, caps: list[int],
              progress: Callable[[int, int], None] = lambda cap, done: None) -> list[SweepRow]:
    """Each cap in turn on a cold prefix cache; `progress(cap, n)` after n more requests finish. Marks the knee."""
    warmup = Workload(workload.prompts[:WARMUP_REQUESTS],
                      [SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)] * WARMUP_REQUESTS,
                      workload.loras[:WARMUP_REQUESTS])
    run_cap(engine, warmup, max(caps))
    rows = [run_cap(engine, workload, cap, lambda n, cap=cap: progress(cap, n)) for cap in caps]
    knee = find_knee(rows)
    for row in rows:
        row.knee = row.max_num_seqs == knee
    return rows


def run_cap(engine: LLMEngine, workload: Workload, cap: int,
            progress: Callable[[int], None] = lambda n: None) -> SweepRow:
    """Every request queued at once (a batch's view: time to first token includes the wait for a slot), then steps
    until all finish."""
    set_max_num_seqs(engine, cap)
    engine.reset_prefix_cache()  # each cap computes every prompt: a warm cache would favour the later caps
    start_time, start = time.time(), time.perf_counter()
    failed = 0
    for i, (prompt, params, lora) in enumerate(zip(workload.prompts, workload.params, workload.loras)):
        try:
            engine.add_request(prompt, params, f"sweep-{cap}-{i}", arrival_time=start_time, lora_request=lora)
        except RequestRejected:
            failed += 1
    progress(failed)
    outputs: list[RequestOutput] = []
    kv_seconds, busy, preemptions = 0.0, 0.0, 0
    while engine.has_unfinished_requests():
        finished = engine.step(finished_only=True)
        step = engine.last_step
        if step is not None:
            kv_seconds += step.seconds * step.kv_blocks_used / engine.block_manager.num_blocks
            busy += step.seconds
            preemptions += step.num_preemptions
        outputs += finished
        if finished:
            progress(len(finished))
    seconds = time.perf_counter() - start
    return summarise(cap, outputs, failed, seconds, kv_seconds / busy if busy else 0.0, preemptions)


def set_max_num_seqs(engine: LLMEngine, cap: int) -> None:
    """Reconfigure the loaded engine between runs: its scheduler reads the cap each step, and nothing else it holds
    depends on it (the KV cache was sized for the largest cap)."""
    engine.config.max_num_seqs = cap
    engine.scheduler.max_num_seqs = cap


def summarise(cap: int, outputs: list[RequestOutput], failed: int, seconds: float, mean_kv_use: float,
              preemptions: int) -> SweepRow:
    done = [out for out in outputs if out.error is None]
    failed += len(outputs) - len(done)
    ttft = [out.metrics.first_token_time - out.metrics.arrival_time for out in done] or [0.0]
    latency = [out.metrics.finish_time - out.metrics.arrival_time for out in done] or [0.0]
    tokens = sum(out.num_completion_tokens for out in done)
    return SweepRow(cap, len(done), failed, seconds, tokens, tokens / seconds, len(done) / seconds,
                    _percentile(ttft, 50), _percentile(ttft, 95), _percentile(latency, 50), _percentile(latency, 95),
                    mean_kv_use, preemptions)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def find_knee(rows: list[SweepRow]) -> int:
    """The smallest cap whose throughput is within 5% of the best: past it, a larger batch buys little."""
    best = max(row.output_tokens_per_s for row in rows)
    return min(row.max_num_seqs for row in rows if row.output_tokens_per_s >= KNEE_FRACTION * best)
